"""Generate docs/config-reference.md from the schema in grpo/config/schema.py, so the reference cannot drift.

Every key of `grpo.config.schema.Config` with its type, default and meaning. The meaning is the comment on
the field's line in grpo/config/schema.py (and any comment lines directly above the field); the allowed
values come from `_CHOICES` / `_RANGES`. Then the config groups (configs/<group>/*.yaml) and the
recipes (recipes/*.yaml), each with the first line of its header comment.

    python scripts/gen_config_docs.py            # rewrite docs/config-reference.md
    python scripts/gen_config_docs.py --check    # exit 1 if the committed file is out of date
"""
from __future__ import annotations

import argparse
import ast
import io
import json
import re
import sys
import tokenize
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path

from grpo.config import schema

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "config-reference.md"
SOURCE = Path(schema.__file__)
# the schema and the sections it imports: evaluation and alarms, the vLLM and server backends
SOURCES = (SOURCE, SOURCE.parent / "evaluation.py", SOURCE.parent / "rollout_backends.py")

SECTIONS = {  # one line per top-level group, shown under its heading
    "model": "Which model to train and how it is loaded.",
    "data": "Where prompts come from and how they are turned into model input (see [data.md](data.md), "
            "[tasks.md](tasks.md)).",
    "reward": "The reward functions and how they are run (see [rewards.md](rewards.md)).",
    "rollout": "Sampling the G completions of every prompt.",
    "algorithm": "The GRPO objective: advantages, clipping, KL, loss aggregation.",
    "engine": "The training forward pass (see [prefix-engine.md](prefix-engine.md)).",
    "trainer": "Optimisation, checkpoints, resume, held-out evaluation.",
    "logging": "metrics.jsonl, console lines, samples, plots, wandb.",
    "distributed": "Several processes with DeepSpeed (see [distributed.md](distributed.md)).",
    "evaluation": "Held-out evaluation: greedy or sampled (pass@k, maj@k, mean@n), named sets (see "
                  "[evaluation.md](evaluation.md)).",
    "alarms": "Rules over each step's metrics that warn of a silent failure (see "
              "[evaluation.md](evaluation.md#alarms)).",
}


# ------------------------------------------------------------------------------- the schema's comments
def field_comments(source: str | None = None) -> dict[tuple[str, str], str]:
    """(dataclass name, field name) -> the comment text of that field in grpo/config/schema.py."""
    source = SOURCE.read_text() if source is None else source
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = source.splitlines()
    out = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        for item in node.body:
            if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                continue
            above, ln = [], item.lineno - 1
            while ln >= 1 and lines[ln - 1].strip().startswith("#"):  # whole-line comments right above
                above.insert(0, comments.get(ln, ""))
                ln -= 1
            inline = [comments[l] for l in range(item.lineno, (item.end_lineno or item.lineno) + 1) if l in comments
                      and not lines[l - 1].strip().startswith("#")]
            text = " ".join(t for t in above + inline if t)
            out[(node.name, item.target.id)] = text
    return out


def annotations(source: str | None = None) -> dict[tuple[str, str], str]:
    """(dataclass name, field name) -> the annotation as written (``Optional[float]``)."""
    source = SOURCE.read_text() if source is None else source
    out = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    out[(node.name, item.target.id)] = ast.unparse(item.annotation)
    return out


def _yaml(v) -> str:
    """A default as it is written in YAML (flow style)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v) if (v == "" or any(c in v for c in ":{}[],#&*!|>'\"%@`") or v.strip() != v
                                 or v in ("null", "true", "false")) else v
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_yaml(x)}" for k, x in v.items()) + "}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_yaml(x) for x in v) + "]"
    return str(v)


def _default(f):
    if f.default_factory is not MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return f.default


def rows(cls=schema.Config, prefix: str = "", obj=None, note: str = "") -> list[dict]:
    """One dict per leaf key: key, type, default, meaning, allowed (depth-first, schema order). ``obj``: the
    section's default instance (an alarm's own threshold and patience); ``note``: the comment of the field holding
    it (what that alarm's threshold means)."""
    comments, types = {}, {}
    for src in SOURCES:
        comments.update(field_comments(src.read_text()))
        types.update(annotations(src.read_text()))
    out = []
    for f in fields(cls):
        key = f"{prefix}{f.name}"
        default = _default(f) if obj is None else getattr(obj, f.name)
        if is_dataclass(default):
            out.extend(rows(type(default), key + ".", default, comments.get((cls.__name__, f.name), "")))
            continue
        allowed = ""
        if key in schema._CHOICES:
            allowed = " \\| ".join(f"`{c}`" for c in schema._CHOICES[key])
        elif key in schema._RANGES:
            allowed = schema._RANGES[key][1]
        out.append({"key": key, "type": types.get((cls.__name__, f.name), ""), "default": _yaml(default),
                    "meaning": note if note and f.name == "threshold" else comments.get((cls.__name__, f.name), ""),
                    "allowed": allowed})
    return out


def _cell(s: str) -> str:
    """Text for a table cell: pipes escaped, and <tags> shown rather than taken as HTML."""
    return s.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


# ------------------------------------------------------------------------------- groups and recipes
def header_comment(path: Path) -> str:
    """The first sentence of a YAML file's header comment (``# @package`` lines skipped; the sentence may
    run over several comment lines; indented lines such as example commands end it)."""
    parts: list[str] = []
    for line in path.read_text().splitlines():
        s = line.strip()
        if not s.startswith("#"):
            if s or parts:
                break
            continue
        text = s[1:]
        if text.strip().startswith("@package"):
            continue
        if not text.strip() or (parts and text.startswith("   ")):
            break
        parts.append(text.strip())
    joined = " ".join(parts)
    m = re.match(r"(.+?[.!?])(\s|$)", joined)
    return m.group(1) if m else joined


def group_options() -> dict[str, list[Path]]:
    cdir = ROOT / "configs"
    return {d.name: sorted(d.glob("*.yaml")) for d in sorted(cdir.iterdir()) if d.is_dir() and not d.is_symlink()}


def _defaults() -> dict[str, str]:
    """group -> the option configs/config.yaml selects."""
    from omegaconf import OmegaConf

    out = {}
    for item in OmegaConf.to_container(OmegaConf.load(ROOT / "configs" / "config.yaml")).get("defaults", []):
        if isinstance(item, dict):
            out.update({str(k): str(v) for k, v in item.items()})
    return out


# ------------------------------------------------------------------------------------------ render
def render() -> str:
    md = ["# Config reference", "",
          "<!-- Generated by `python scripts/gen_config_docs.py` from grpo/config/schema.py, configs/ and recipes/. "
          "Do not edit by hand; tests/e2e/test_config_reference.py fails when it is out of date. -->", "",
          "Every key of the schema (`grpo.config.schema.Config`), its type, its default and what it means. The YAML "
          "in `configs/` and `recipes/` mirrors these dataclasses key for key; set any key on the command line "
          "Hydra-style (`grpo-train recipe=smoke trainer.lr=1e-5`). A key that does not exist, a value of the "
          "wrong type or outside *allowed* fails before any model loads, with one line naming the key.", "",
          "The defaults below are the schema's. The config groups in `configs/` (listed at the end) set most "
          "of them again, and a recipe may change any; `grpo-train recipe=NAME --cfg job` prints the composed "
          "config of a recipe without running it.", ""]
    all_rows = rows()
    md += ["Groups: " + ", ".join(f"[`{g}`](#{g})" for g in SECTIONS), ""]
    for group in [f.name for f in fields(schema.Config)]:
        md += [f"## {group}", "", SECTIONS.get(group, ""), "",
               "| key | type | default | meaning | allowed |", "|---|---|---|---|---|"]
        for r in all_rows:
            if r["key"].split(".")[0] == group:
                md.append(f"| `{r['key']}` | `{r['type']}` | `{_cell(r['default'])}` | {_cell(r['meaning'])} "
                          f"| {r['allowed']} |")
        md.append("")
    md += ["## Config groups", "",
           "Pick an option of a group with `GROUP=OPTION` on the command line (`distributed=zero3`) or "
           "`override /GROUP: OPTION` in a recipe's `defaults`. *default* is what `configs/config.yaml` selects.",
           "", "| group | option | default | what it is |", "|---|---|---|---|"]
    chosen = _defaults()
    for group, paths in group_options().items():
        for p in paths:
            mark = "yes" if chosen.get(group) == p.stem else ""
            md.append(f"| `{group}` | `{p.stem}` | {mark} | {_cell(header_comment(p))} |")
    md += ["", "## Recipes", "",
           "`grpo-train recipe=NAME` (files in `recipes/`; details in [recipes.md](recipes.md)). "
           f"Without `recipe=`, `{chosen.get('recipe', 'quickstart')}` is used.", "",
           "| recipe | what it is |", "|---|---|"]
    for p in sorted((ROOT / "recipes").glob("*.yaml")):
        md.append(f"| `{p.stem}` | {_cell(header_comment(p))} |")
    md.append("")
    return "\n".join(md)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the file differs from what would be written")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    text = render()
    out = Path(args.out)
    if args.check:
        if not out.exists() or out.read_text() != text:
            print(f"{out} is out of date; run: python scripts/gen_config_docs.py", file=sys.stderr)
            sys.exit(1)
        print(f"{out} is up to date")
        return
    out.write_text(text)
    print(f"wrote {out} ({len(rows())} keys)")


if __name__ == "__main__":
    main()
