"""Math answer accuracy: the completion's final answer against the reference, equivalent forms accepted.

Score: 1.0 when the final answer equals the reference (``0.5`` = ``1/2`` = ``\\frac{1}{2}``,
``1,000`` = ``1000``, ``x = 3`` = ``3``, ``\\sqrt{2}`` = ``2^{1/2}``), 0.0 when it differs or no
answer can be found, None when the row has no reference. Never raises on garbage.

Plain numbers (integers, decimals, ``a/b``, ``\\frac{a}{b}``) are compared in pure Python; anything
else goes to ``math_verify``. Its timeout uses ``signal.alarm``, which only works in the main
thread, so off the main thread it runs without one; candidates that could make sympy compute for
minutes (power towers, huge exponents or factorials, very long strings) are never handed to it.
"""
from __future__ import annotations

import functools
import logging
import re
import threading
from fractions import Fraction

from grpo.rewards.registry import register

_NUM = r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+(?:\.\d+)?)?"
_LAST_NUM = re.compile(r"(?<![\w.])" + _NUM)
_PLAIN = re.compile(r"^(-?)(\d+(?:,\d{3})*(?:\.\d+)?|\.\d+)(?:/(\d+))?$")
_FRAC = re.compile(r"^(-?)\\[dt]?frac\{(\d+)\}\{(\d+)\}$")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S | re.I)
_ANSWER_IS = re.compile(r"(?:final answer|answer)\s*(?:is|:)\s*:?\s*(.+)", re.I)
_MAX_LEN = 400


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (braces balanced), or ``\\boxed 5``."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = start + (6 if text.startswith("\\boxed", start) else 5)
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text):
        return None
    if text[i] != "{":
        m = re.match(r"[^\s$]+", text[i:])
        return m.group(0) if m else None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


def extract_answer(completion: str) -> str | None:
    """The final answer written in ``completion``: ``\\boxed{}``, ``<answer>`` tags, "answer is"/
    "Answer:", else the last number. None when there is nothing that looks like an answer."""
    if not isinstance(completion, str) or not completion.strip():
        return None
    text = completion
    if "</think>" in text:  # the reasoning may try several answers; only the conclusion counts
        reasoning, _, conclusion = text.rpartition("</think>")
        text = conclusion if conclusion.strip() else reasoning  # no conclusion: the reasoning's last answer
    boxed = last_boxed(text)
    if boxed is not None and boxed.strip():
        return boxed.strip()
    tags = _ANSWER_TAG.findall(text)
    if tags and tags[-1].strip():
        inner = tags[-1].strip()
        return last_boxed(inner) or inner
    said = _ANSWER_IS.findall(text)
    if said:
        cand = re.sub(r"^[\s$]+|[\s$.]+$", "", said[-1])  # "$42$." -> "42"
        lead = re.match(r"(" + _NUM + r")\s+[A-Za-z]", cand)  # "5 apples" -> "5"
        if lead:
            return lead.group(1)
        if cand:
            return cand
    nums = _LAST_NUM.findall(text)
    return nums[-1] if nums else None


def _reference(ref) -> str | None:
    if ref is None:
        return None
    if isinstance(ref, (list, tuple)):
        ref = ref[0] if ref else None
        return _reference(ref)
    s = str(ref).strip()
    if "####" in s:  # GSM8K-style "reasoning #### 72"
        s = s.rsplit("####", 1)[1].strip()
    boxed = last_boxed(s)
    if boxed:
        s = boxed.strip()
    return s or None


def as_number(s: str) -> Fraction | None:
    """``s`` as an exact number when it is a plain one (``-1,234.5``, ``3/4``, ``\\frac{3}{4}``)."""
    s = s.strip().strip("$").strip().replace("\\!", "").replace("{,}", ",").replace("\\$", "")
    s = s.replace(" ", "").rstrip(".")
    if s.startswith("+"):
        s = s[1:]
    m = _PLAIN.match(s)
    try:
        if m:
            val = Fraction(m.group(2).replace(",", ""))
            if m.group(3):
                val /= int(m.group(3))
            return -val if m.group(1) else val
        m = _FRAC.match(s)
        if m:
            val = Fraction(int(m.group(2)), int(m.group(3)))
            return -val if m.group(1) else val
    except (ValueError, ZeroDivisionError):
        return None
    return None


def _numbers_equal(a: Fraction, b: Fraction) -> bool:
    return a == b or abs(a - b) <= Fraction(1, 10**6) * max(1, abs(b))


_DANGER = (
    re.compile(r"\^\s*\{[^{}]*(\^|\*\*)"),                 # nested power  a^{b^{c}}
    re.compile(r"(\^|\*\*)\s*[\w.]+\s*(\^|\*\*)"),         # chained power a^b^c
    re.compile(r"(\^|\*\*)\s*\{?\s*\d{5,}"),               # exponent >= 10000
    re.compile(r"\d{4,}\s*!|\d{4,}\}\s*!"),               # factorial of >= 1000
)


def _safe_for_sympy(s: str) -> bool:
    return len(s) <= _MAX_LEN and not any(p.search(s) for p in _DANGER)


class _DropTimeoutNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutNotice())


def _load_math_verify():
    """math_verify's parse and verify, warmed up once without a timeout: the first call builds its LaTeX
    grammar and loads sympy (seconds on a loaded machine), which a sample's timeout must not be charged for."""
    from math_verify import parse, verify

    verify(parse("$\\sqrt{2}$", parsing_timeout=None), parse("$2^{1/2}$", parsing_timeout=None), timeout_seconds=None)
    return parse, verify


# cached by a call, not as a decorator: mutmut (`make mutate`) does not mutate a decorated function
_math_verify = functools.cache(_load_math_verify)


def _math_verify_equal(ref: str, cand: str, timeout_s: int) -> bool:
    parse, verify = _math_verify()
    t = timeout_s if threading.current_thread() is threading.main_thread() else None
    gold = parse(ref if "$" in ref else f"${ref}$", parsing_timeout=t)
    if not gold:
        return False
    pred = parse("\\boxed{" + cand + "}", parsing_timeout=t) or parse(f"${cand}$", parsing_timeout=t)
    return bool(pred) and bool(verify(gold, pred, timeout_seconds=t))


def _norm_text(s: str) -> str:
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    return re.sub(r"[\s$]+", "", s).rstrip(".").lower()


def is_correct(completion: str, reference, timeout_s: int = 3) -> float | None:
    """1.0 / 0.0 for one completion against one reference; None when there is no reference."""
    ref = _reference(reference)
    if ref is None:
        return None
    try:
        cand = extract_answer(completion)
        if cand is None:
            return 0.0
        if _norm_text(cand) == _norm_text(ref):
            return 1.0
        a, b = as_number(cand), as_number(ref)
        if a is not None and b is not None:
            return float(_numbers_equal(a, b))
        if not (_safe_for_sympy(cand) and _safe_for_sympy(ref)):
            return 0.0
        return float(_math_verify_equal(ref, cand, max(1, int(timeout_s))))
    except BaseException as e:  # math_verify's TimeoutException derives from BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        return 0.0


def math_accuracy(prompts: list[str], completions: list[str], answer: list | None = None,
                  timeout_s: int = 3, **_) -> list[float | None]:
    """1.0 when the completion's final answer is mathematically equal to the row's ``answer``
    (column), 0.0 otherwise, None for rows without a reference. ``timeout_s``: per-comparison
    limit for ``math_verify`` (main thread only)."""
    if answer is None:
        return [None] * len(completions)
    return [is_correct(c, a, timeout_s) for c, a in zip(completions, answer)]


# registered by a call, not as a decorator: mutmut (`make mutate`) does not mutate a decorated function
register("math_accuracy")(math_accuracy)
