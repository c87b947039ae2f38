"""Prompts: built-in generators, local JSONL/Parquet/CSV files, or a `datasets` hub name.

Every row becomes ``{"prompt": <text fed to the model>, "prompt_ids": [...], <columns>...}``; the
answer column travels to the rewards as ``answer``. Prompts longer than ``data.max_prompt_tokens``
are dropped and counted, never truncated silently.
"""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from pathlib import Path

from grpo.errors import DataError
from grpo.vision.images import asks_for_images, image_row

_FILE_TYPES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def load_rows(dcfg, n: int | None = None, seed: int | None = None) -> list[dict]:
    """Raw rows from ``data.source`` (before templating)."""
    src = dcfg.source
    if src.startswith("builtin:"):
        task, kwargs = builtin_task(dcfg)
        try:
            return task(n or dcfg.num_train + dcfg.num_eval, dcfg.seed if seed is None else seed, **kwargs)
        except (ValueError, TypeError) as e:
            raise DataError(f"data.task_kwargs={kwargs} for {src}: {str(e).splitlines()[0]}") from None
    path = _local_file(src)
    if path is not None:
        return _load_dataset(_FILE_TYPES[path.suffix.lower()], data_files=str(path), split="train", src=src)
    return _load_dataset(src, split=dcfg.split, src=src, **dict(dcfg.load_kwargs))


def _local_file(src: str) -> Path | None:
    """The local data file ``src`` names (checked), or None for a hub dataset name."""
    path = Path(src)
    if path.suffix.lower() not in _FILE_TYPES and not path.exists():
        return None
    if path.is_dir():
        raise DataError(f"data.source={src!r} is a folder; give one .jsonl, .parquet or .csv file")
    if not path.is_file():
        raise DataError(f"data.source={src!r}: file not found")
    if path.suffix.lower() not in _FILE_TYPES:
        raise DataError(f"data.source={src!r}: unknown file type; use .jsonl, .parquet or .csv")
    if path.stat().st_size == 0:
        raise DataError(f"data.source={src!r}: the file is empty")
    return path


def builtin_task(dcfg):
    """The task function of a ``builtin:<name>`` source and its ``data.task_kwargs``, checked against its
    signature so that a misspelled or leftover argument is named instead of ignored or crashing later."""
    import difflib
    import inspect

    from grpo.tasks import get_task

    name = dcfg.source.split(":", 1)[1]
    try:
        task = get_task(name)
    except KeyError as e:
        raise DataError(f"data.source={dcfg.source!r}: {e.args[0]}") from None
    kwargs = dict(dcfg.task_kwargs)
    takes = list(inspect.signature(task).parameters)[2:]  # after (n, seed)
    for key in kwargs:
        if key not in takes:
            close = difflib.get_close_matches(key, takes, n=1, cutoff=0.6)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise DataError(f"data.task_kwargs.{key}: builtin:{name} has no argument {key!r}{hint}; it takes "
                            f"{', '.join(takes) or 'no arguments'} (switch tasks with data=<group>, which brings its "
                            "own task_kwargs)")
    return task, kwargs


def check_source(dcfg) -> None:
    """What can be checked before a model loads: a built-in task's arguments (one prompt is generated)
    and that a local source is a file."""
    if dcfg.source.startswith("builtin:"):
        load_rows(dcfg, n=1)
    else:
        _local_file(dcfg.source)


def _load_dataset(*args, src: str, **kwargs) -> list[dict]:
    import datasets

    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset(*args, **kwargs)
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise DataError(f"data.source={src!r} could not be loaded: {first}") from None
    return [dict(r) for r in ds]


ROLES = ("system", "user", "assistant", "tool")


def messages_of(value, where: str) -> list[dict] | None:
    """A conversational prompt (a list of ``{"role", "content"}`` messages, TRL's and verl's format) checked,
    or None for a text prompt."""
    if isinstance(value, str):
        return None
    if not isinstance(value, (list, tuple)) or not all(isinstance(m, dict) for m in value):
        raise DataError(f"{where}: the prompt is neither text nor a list of {{role, content}} messages")
    for m in value:
        if m.get("role") not in ROLES:
            raise DataError(f"{where}: unknown role {m.get('role')!r} in the prompt messages; "
                            f"use {', '.join(ROLES)}")
        if not isinstance(m.get("content"), str):
            raise DataError(f"{where}: a {m['role']} message has no text 'content'")
    if not any(m["role"] == "user" for m in value):
        raise DataError(f"{where}: the prompt messages have no 'user' turn")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def format_prompt(row: dict, dcfg, tokenizer, where: str = "data row",
                  tools: list[dict] | None = None) -> tuple[str, list[dict] | None]:
    """(the text the model continues, the prompt's messages or None). A text prompt is templated
    (``data.prompt_template``) and gets ``data.system_prompt``; a message list goes as it is (the system
    prompt only when it has no system turn). The tokenizer's chat template applies when it has one (with
    ``tools``: their schemas, as multi-turn episodes show them); without, the messages' contents are joined by
    blank lines."""
    turns, messages = prompt_turns(row, dcfg, where)
    return render_turns(turns, dcfg, tokenizer, tools), messages


def prompt_turns(row: dict, dcfg, where: str = "data row") -> tuple[list[dict], list[dict] | None]:
    """(the prompt's turns, system prompt included; the row's own messages or None for a text prompt)."""
    value = row[dcfg.prompt_column]
    messages = messages_of(value, where)
    if messages is None:
        try:
            text = dcfg.prompt_template.format(**{**row, "prompt": value})
        except KeyError as e:
            raise DataError(f"data.prompt_template uses column {e.args[0]!r}, which the data does not have") from None
        turns = [{"role": "user", "content": text}]
    else:
        if dcfg.prompt_template != "{prompt}":
            raise DataError(f"data.prompt_template={dcfg.prompt_template!r} applies to text prompts; {where}'s "
                            "prompt is a list of messages (write the wording into the messages, or drop the template)")
        turns = messages
    if dcfg.system_prompt and not any(m["role"] == "system" for m in turns):
        turns = [{"role": "system", "content": dcfg.system_prompt}, *turns]
    return turns, messages


def render_turns(turns: list[dict], dcfg, tokenizer, tools: list[dict] | None = None) -> str:
    if dcfg.chat_template and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(turns, tools=tools or None, tokenize=False, add_generation_prompt=True)
    return "\n\n".join(m["content"] for m in turns)


def with_extra_text(turns: list[dict], extra: str) -> list[dict]:
    """The turns with ``extra`` (what an environment's reset(row) adds) appended to the last user turn."""
    last = max(i for i, m in enumerate(turns) if m["role"] == "user")
    return [dict(m, content=m["content"] + "\n\n" + extra) if i == last else m for i, m in enumerate(turns)]


def with_system_text(turns: list[dict], text: str) -> list[dict]:
    """The turns with ``text`` (a tool format's description of the tools) after the system turn's content, or as a
    new system turn first."""
    if turns and turns[0]["role"] == "system":
        return [dict(turns[0], content=turns[0]["content"] + "\n\n" + text), *turns[1:]]
    return [{"role": "system", "content": text}, *turns]


def prepare(rows: list[dict], dcfg, tokenizer, tools: list[dict] | None = None,
            keep_turns: bool = False, system_text: str | None = None, image_processor=None) -> tuple[list[dict], int]:
    """Template and tokenize rows; returns (kept rows, number dropped for length). A conversational row
    keeps its messages under ``prompt_messages`` (what conversational rewards receive as the prompt); with
    ``keep_turns`` (multi-turn episodes) every row keeps its turns under ``prompt_turns``. ``system_text``: added
    to every prompt's system turn (`with_system_text`)."""
    out, dropped = _prepare(rows, dcfg, tokenizer, tools, keep_turns, system_text, image_processor)
    return out, len(dropped)


def _prepare(rows, dcfg, tokenizer, tools, keep_turns, system_text=None,
             image_processor=None) -> tuple[list[dict], list[int]]:
    """`prepare`, with the token length of every dropped prompt."""
    out, dropped = [], []
    for i, row in enumerate(rows):
        if dcfg.prompt_column not in row or row[dcfg.prompt_column] is None or row[dcfg.prompt_column] == "":
            raise DataError(f"data row {i} has no '{dcfg.prompt_column}' value (data.prompt_column); "
                            f"its columns are: {', '.join(map(str, row))}")
        if row.get(dcfg.image_column):  # a prompt with images (grpo/vision/images.py)
            prepared = image_row(row, dcfg, tokenizer, image_processor, where=f"data row {i}")
            if len(prepared["prompt_ids"]) > dcfg.max_prompt_tokens:
                dropped.append(len(prepared["prompt_ids"]))
            else:
                out.append(prepared)
            continue
        if n := asks_for_images(row[dcfg.prompt_column]):
            raise DataError(f"data row {i}: its prompt places {n} image(s) but the row has no images in "
                            f"data.image_column={dcfg.image_column!r}; its columns are: {', '.join(map(str, row))}")
        turns, messages = prompt_turns(row, dcfg, where=f"data row {i}")
        if system_text:
            turns = with_system_text(turns, system_text)
        text = render_turns(turns, dcfg, tokenizer, tools)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > dcfg.max_prompt_tokens:
            dropped.append(len(ids))
            continue
        cols = {k: v for k, v in row.items() if k != dcfg.prompt_column}
        if dcfg.answer_column in row and dcfg.answer_column != "answer":
            cols["answer"] = row[dcfg.answer_column]
        if messages is not None:
            cols["prompt_messages"] = messages
        if keep_turns:
            cols["prompt_turns"] = turns
        out.append({**cols, "prompt": text, "prompt_ids": ids})
    return out, dropped


def check_columns(rows: list[dict], dcfg) -> None:
    """Every column the config names is in the data (in some row), else one line listing the columns there are:
    data.prompt_column, each ``{column}`` of data.prompt_template, and data.answer_column when it is not the default
    ``answer`` (a task whose rewards need no reference has none)."""
    import string

    have = list(dict.fromkeys(k for row in rows for k in row))
    there = f"the data's columns are: {', '.join(map(str, have))}"
    named = [("data.prompt_column", dcfg.prompt_column)]
    if dcfg.answer_column != "answer":
        named.append(("data.answer_column", dcfg.answer_column))
    for key, column in named:
        if column not in have:
            raise DataError(f"{key}={column!r}: the data has no such column; {there}")
    try:
        used = [f for _, f, _, _ in string.Formatter().parse(dcfg.prompt_template) if f]
    except ValueError as e:
        raise DataError(f"data.prompt_template={dcfg.prompt_template!r}: {e}") from None
    for field_name in used:
        column = field_name.split(".")[0].split("[")[0]
        if column != "prompt" and column not in have:
            raise DataError(f"data.prompt_template uses column {column!r}, which the data does not have; {there}")


@dataclass
class Splits:
    train: list[dict]
    eval: list[dict]
    dropped: int = 0
    note: str = ""  # one line for the console: fewer held-out prompts than data.num_eval asked for, and why
    sets: dict[str, list[dict]] = field(default_factory=dict)  # evaluation.sets by name (`build_sets`)


def build(dcfg, tokenizer, tools: list[dict] | None = None, keep_turns: bool = False,
          system_text: str | None = None, sets: list[dict] = (), image_processor=None) -> Splits:
    """Train and held-out rows, and the named evaluation sets (``sets``: `build_sets`). Built-in tasks draw disjoint
    prompts; files hold out their tail; a training prompt that is in a named set is dropped. ``tools``,
    ``keep_turns`` and ``system_text``: see `prepare`; ``image_processor``: the model's, for rows with images
    (None: a text model, which such rows are refused for)."""
    splits = _build(dcfg, tokenizer, tools, keep_turns, system_text, image_processor)
    if sets:
        splits.sets = build_sets(sets, dcfg, tokenizer, tools, keep_turns, system_text, image_processor)
        held = {_prompt_key(r) for rows in splits.sets.values() for r in rows}
        train = [r for r in splits.train if _prompt_key(r) not in held]
        if not train:
            raise DataError("every training prompt is also in an evaluation set (evaluation.sets); give the sets "
                            "another source, seed or task_kwargs")
        if len(train) < len(splits.train):
            splits.note = "; ".join(filter(None, [splits.note, f"{len(splits.train) - len(train)} training prompts "
                                                  "that are in an evaluation set were dropped"]))
        splits.train = train
    return splits


def set_source(spec: dict, dcfg):
    """The data section a named evaluation set (``spec``: one of evaluation.sets) reads: its source keys are its own
    (the `DataConfig` defaults where it gives none), the rendering keys (template, system prompt, chat template,
    prompt length) the data's unless it gives them."""
    own = {k: v for k, v in spec.items() if k not in ("name", "num")}
    source_keys = ("split", "load_kwargs", "task_kwargs", "prompt_column", "answer_column")
    base = dataclasses.replace(dcfg, **{k: getattr(type(dcfg)(), k) for k in source_keys})
    return dataclasses.replace(base, **own)


def set_rows(spec: dict, dcfg) -> list[dict]:
    """A named set's raw rows: a built-in task's first ``num`` prompts (100 by default), a file's or a hub split's
    first ``num`` rows (every row by default)."""
    scfg = set_source(spec, dcfg)
    num = spec.get("num")
    where = f"evaluation.sets {spec['name']}"
    try:
        rows = load_rows(scfg, n=num or 100) if scfg.source.startswith("builtin:") else load_rows(scfg)[:num]
    except DataError as e:
        raise DataError(f"{where}: {e}") from None
    if not rows:
        raise DataError(f"{where}: source {scfg.source!r} has no rows")
    if scfg.prompt_column not in rows[0]:
        raise DataError(f"{where}: no column {scfg.prompt_column!r} (prompt_column); its columns are: "
                        f"{', '.join(map(str, rows[0]))}")
    return rows


def build_sets(specs: list[dict], dcfg, tokenizer, tools=None, keep_turns: bool = False,
               system_text: str | None = None, image_processor=None) -> dict[str, list[dict]]:
    """{name: prepared rows} of evaluation.sets, in order (prompts longer than max_prompt_tokens are dropped)."""
    out = {}
    for spec in specs:
        rows, _ = _prepare(set_rows(spec, dcfg), set_source(spec, dcfg), tokenizer, tools, keep_turns, system_text,
                           image_processor)
        if not rows:
            raise DataError(f"evaluation.sets {spec['name']}: every prompt is longer than max_prompt_tokens")
        out[spec["name"]] = rows
    return out


def _build(dcfg, tokenizer, tools, keep_turns, system_text, image_processor) -> Splits:
    rows = load_rows(dcfg)
    if not rows:
        raise DataError(f"data.source={dcfg.source!r} has no rows")
    check_columns(rows, dcfg)
    rows, dropped = _prepare(rows, dcfg, tokenizer, tools, keep_turns, system_text, image_processor)
    if not rows:
        raise DataError(f"every prompt is longer than data.max_prompt_tokens={dcfg.max_prompt_tokens}: the shortest "
                        f"is {min(dropped)} tokens (as the model sees it, template included); raise "
                        f"data.max_prompt_tokens to at least {min(dropped)}")
    n_eval, note = _held_out_count(dcfg, len(rows))
    if dcfg.source.startswith("builtin:"):
        # generators may repeat a problem; keep held-out prompts out of the training set
        eval_rows = rows[:n_eval]
        seen = {_prompt_key(r) for r in eval_rows}
        train_rows = [r for r in rows[n_eval:] if _prompt_key(r) not in seen]
    else:
        train_rows, eval_rows = rows[: len(rows) - n_eval], rows[len(rows) - n_eval:]
    if not train_rows:
        raise DataError("no training rows left after holding out data.num_eval; lower data.num_eval")
    return Splits(train_rows, eval_rows, len(dropped), note)


def _prompt_key(row: dict):
    """What makes two prompts the same: their text, and their images' pixels when they have images."""
    pixels = getattr(row["prompt_ids"], "pixel_values", None)
    if pixels is None:
        return row["prompt"]
    import hashlib

    return row["prompt"], hashlib.sha1(pixels.numpy().tobytes()).hexdigest()


def _held_out_count(dcfg, n_rows: int) -> tuple[int, str]:
    """How many rows to hold out, and a note when it is fewer than data.num_eval: a built-in task generates
    them all; a file holds out at most a fifth of its rows (so a file of fewer than 5 rows holds out none)."""
    if dcfg.source.startswith("builtin:") or dcfg.num_eval <= n_rows // 5:
        return dcfg.num_eval, ""
    n = n_rows // 5
    why = (f"data.num_eval={dcfg.num_eval} but {dcfg.source} has {n_rows} usable rows and a file holds out at most a "
           "fifth of them: ")
    if n == 0:
        return 0, why + "held-out evaluation is off (it needs 5 rows or more; data.num_eval=0 silences this)"
    return n, why + f"{n} held out"


@dataclass
class PromptSampler:
    """Endless shuffled passes over the training rows; its state is an int pair, saved in checkpoints."""

    num_rows: int
    seed: int
    epoch: int = 0
    position: int = 0
    _order: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self):
        self._order = self._shuffle(self.epoch)

    def _shuffle(self, epoch: int) -> list[int]:
        order = list(range(self.num_rows))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next(self, n: int) -> list[int]:
        out = []
        while len(out) < n:
            if self.position >= self.num_rows:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._shuffle(self.epoch)
            out.append(self._order[self.position])
            self.position += 1
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "num_rows": self.num_rows, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._shuffle(self.epoch)
