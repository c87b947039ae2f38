"""Metrics: one JSON line per optimizer step in ``metrics.jsonl``, a readable console line, wandb,
sample completions every N steps, and a reward-curve PNG at the end."""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import uuid
from pathlib import Path

WANDB_ID = "wandb_run_id"
CONSOLE_KEYS = [("reward_mean", "reward", "{:.3f}"), ("reward_std", "±", "{:.3f}"), ("loss", "loss", "{:+.4f}"),
                ("kl", "kl", "{:.4f}"), ("clip_ratio", "clip", "{:.3f}"), ("completion_len_mean", "len", "{:.1f}"),
                ("grad_norm", "|g|", "{:.3f}"), ("step_time_s", "s/step", "{:.1f}")]


def interactive() -> bool:
    """Progress bars only on a terminal: in a log file their redraws are noise."""
    return sys.stderr.isatty()


def quiet_when_not_interactive() -> None:
    """Turn off transformers' and the hub's own progress bars (``Loading weights``, ``Writing model shards``)
    when stderr is not a terminal."""
    if not interactive():
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


LOG = "train.log"


class _Tee:
    """stderr, with each complete line also appended to the run's ``train.log`` (of a line a progress bar redraws
    with ``\\r``, its last state). Lines written before the output directory exists are kept until it does."""

    def __init__(self, stream, path: Path):
        self.stream, self.path = stream, path
        self._file, self._line, self._pending = None, "", []

    def write(self, text: str) -> int:
        n = self.stream.write(text)
        *done, self._line = (self._line + text).split("\n")
        self._pending += [line.rsplit("\r", 1)[-1] + "\n" for line in done]
        self._drain()
        return n

    def _drain(self) -> None:
        if self._pending and (self._file is not None or self.path.parent.is_dir()):
            self._file = self._file or self.path.open("a")
            self._file.write("".join(self._pending))
            self._file.flush()
            self._pending = []

    def flush(self) -> None:
        self.stream.flush()

    def close(self) -> None:
        if self._line:
            self._pending.append(self._line.rsplit("\r", 1)[-1] + "\n")
        self._drain()
        if self._file is not None:
            self._file.close()

    def __getattr__(self, name):  # isatty, fileno, encoding, ...: the terminal's
        return getattr(self.stream, name)


def run_log(output_dir: str, enabled: bool = True):
    """While inside: what the trainer prints (stderr) also goes to ``<output_dir>/train.log``, appended (a resume
    continues the log). Nested uses for the same directory write each line once."""
    path = Path(output_dir).absolute() / LOG
    if not enabled or (isinstance(sys.stderr, _Tee) and sys.stderr.path == path):
        yield
        return
    tee = sys.stderr = _Tee(sys.stderr, path)
    try:
        yield
    finally:
        if sys.stderr is tee:
            sys.stderr = tee.stream
        tee.close()


# a context manager by a call, not as a decorator: mutmut (`make mutate`) does not mutate a decorated function
run_log = contextlib.contextmanager(run_log)


class MetricsLogger:
    def __init__(self, output_dir: str, cfg_dict: dict | None = None, wandb_cfg: dict | None = None,
                 enabled: bool = True, resumed: bool = False):
        self.dir = Path(output_dir)
        self.enabled = enabled
        self.path = self.dir / "metrics.jsonl"
        self.samples_path = self.dir / "samples.jsonl"
        self._wandb, self._online = None, False
        if not enabled:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        wandb_cfg = dict(wandb_cfg or {})
        if os.environ.get("WANDB_MODE") in ("online", "offline", "disabled"):
            wandb_cfg["mode"] = os.environ["WANDB_MODE"]
        if wandb_cfg.get("mode", "disabled") != "disabled":
            import wandb

            self._online = wandb_cfg["mode"] == "online"
            os.environ.setdefault("WANDB_SILENT", "true")
            self._wandb = wandb.init(project=wandb_cfg.get("project", "grpo"), name=wandb_cfg.get("name"),
                                     mode=wandb_cfg["mode"], dir=str(self.dir), config=cfg_dict or {},
                                     id=self._wandb_id(resumed), resume="allow")

    def _wandb_id(self, resumed: bool) -> str:
        """One wandb run per output directory: its id is kept in ``<output_dir>/wandb_run_id``; a resume continues
        that run, a fresh start (step 0) gets a new one."""
        f = self.dir / WANDB_ID
        kept = f.read_text().strip() if resumed and f.is_file() else ""
        if kept:
            return kept
        run_id = uuid.uuid4().hex[:12]
        f.write_text(run_id + "\n")
        return run_id

    def truncate_after(self, step: int) -> int:
        """Drop the lines of steps after ``step`` (a resume from ``step`` replaces them); returns how many
        metrics.jsonl lines went."""
        dropped = 0
        for path in (self.path, self.samples_path):
            if self.enabled and path.exists():
                rows = read_metrics(path)
                kept = [m for m in rows if m.get("step", 0) <= step]
                if len(kept) < len(rows):
                    path.write_text("".join(json.dumps(m) + "\n" for m in kept))
                dropped += (len(rows) - len(kept)) * (path == self.path)
        return dropped

    def logged_eval(self, step: int) -> dict:
        """The held-out evaluation logged at ``step`` (``eval/<name>`` keys, without the prefix); {} if none."""
        if not (self.enabled and self.path.exists()):
            return {}
        rows = [m for m in read_metrics(self.path) if m.get("step") == step and any(k.startswith("eval/") for k in m)]
        return {k[len("eval/"):]: v for k, v in rows[0].items() if k.startswith("eval/")} if rows else {}

    def log(self, metrics: dict, console: bool = True, progress: str | None = None) -> None:
        """``progress``: the console line's head in place of ``step N`` (`grpo.trainer.progress.StepClock`)."""
        if not self.enabled:
            return
        clean = {k: (v.item() if hasattr(v, "item") else v) for k, v in metrics.items()}
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in clean.items()}
        with self.path.open("a") as f:
            f.write(json.dumps(clean) + "\n")
            f.flush()
        if self._wandb is not None:
            self._wandb.log(clean, step=clean.get("step"))
        if console:
            print(format_line(clean, progress), file=sys.stderr, flush=True)

    def samples(self, step: int, rows: list[dict]) -> None:
        if not self.enabled:
            return
        with self.samples_path.open("a") as f:
            for r in rows:
                f.write(json.dumps({"step": step, **r}) + "\n")
        for r in rows:
            text = r["completion"].replace("\n", "\\n")
            print(f"  sample  reward={r['reward']:.2f}  answer={r.get('answer')!s:<8} | {text[:160]}", file=sys.stderr)

    def completions(self, step: int, rows: list[dict]) -> None:
        """The step's completions as a wandb Table ``completions`` (TRL's ``log_completions``): step, prompt,
        completion, each reward function's score, the total reward and the advantage; one row per dict."""
        if not (self.enabled and self._wandb is not None and rows):
            return
        import wandb

        columns = ["step", *rows[0]]
        table = wandb.Table(columns=columns, data=[[step, *r.values()] for r in rows])
        self._wandb.log({"completions": table}, step=step)

    def alert(self, title: str, text: str) -> None:
        """A wandb alert (an e-mail or Slack message, as the user's wandb settings say) when wandb is online."""
        if self._wandb is not None and self._online:
            self._wandb.alert(title=title, text=text)

    def finish(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()


def format_line(m: dict, progress: str | None = None) -> str:
    """The console line of a step. A ``kl`` that is logged but null (``algorithm.beta=0``: no reference model, so
    no KL is measured; metrics.jsonl holds null) reads ``kl n/a``, not 0 and not a silent gap."""
    parts = [progress or f"step {m.get('step', '?'):>4}"]
    for key, label, fmt in CONSOLE_KEYS:
        if m.get(key) is not None:
            parts.append(f"{label} {fmt.format(m[key])}")
        elif key == "kl" and key in m:
            parts.append(f"{label} n/a")
    return "  ".join(parts)


def read_metrics(path: str | Path) -> list[dict]:
    """Lines of a metrics.jsonl, tolerating a half-written last line (a run still going)."""
    out = []
    p = Path(path)
    if not p.exists():
        return out
    for line in p.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def ascii_curve(values: list[float], width: int = 60, height: int = 8, label: str = "reward") -> str:
    """A small terminal plot of ``values`` (one column per bucket of steps)."""
    vals = [v for v in values if v is not None]
    if not vals:
        return ""
    buckets = [vals[int(i * len(vals) / min(width, len(vals))): int((i + 1) * len(vals) / min(width, len(vals)))]
               for i in range(min(width, len(vals)))]
    pts = [sum(b) / len(b) for b in buckets if b]
    lo, hi = min(pts), max(pts)
    span = (hi - lo) or 1.0
    rows = []
    for r in range(height, -1, -1):
        level = lo + span * r / height
        line = "".join("█" if (p - lo) / span * height >= r - 1e-9 else " " for p in pts)
        rows.append(f"{level:7.3f} |{line}")
    rows.append(" " * 8 + "+" + "-" * len(pts))
    rows.append(" " * 9 + f"{label} over {len(vals)} step{'s' * (len(vals) != 1)}")
    return "\n".join(rows)


def integer_steps(ax, steps: list) -> None:
    """Whole-number step ticks, and a readable axis when there is a single step."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if steps and min(steps) == max(steps):
        ax.set_xlim(min(steps) - 1, max(steps) + 1)


def plot_curves(metrics: list[dict], path: str | Path, keys=("reward_mean", "kl", "completion_len_mean")) -> None:
    """PNG with one panel per metric against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in keys if any(m.get(k) is not None for m in metrics)]
    if not keys:
        return
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.2), squeeze=False)
    for ax, k in zip(axes[0], keys):
        pts = [(m["step"], m[k]) for m in metrics if m.get(k) is not None]
        ax.plot(*zip(*pts), marker=".", lw=1)
        ax.set_xlabel("step")
        integer_steps(ax, [p[0] for p in pts])
        ax.set_title(k)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
