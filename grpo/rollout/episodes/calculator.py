"""A calculator, both ways a model can be given one (the calculator-tools recipe, docs/tools-and-environments.md):

- ``calculate``: a tool function for models whose chat template shows tools (``rollout.tools:
  [grpo.rollout.episodes.calculator:calculate]``);
- ``Calculator``: a plain-text environment for models without (``rollout.environment:
  grpo.rollout.episodes.calculator:Calculator``): a turn with ``<calc>expression</calc>`` gets ``Result: <value>``
  back as the next user turn; a turn without one ends the episode.

Expressions are parsed, never passed to ``eval``: numbers, + - * / // % **, parentheses; exponents up to 64.
"""
from __future__ import annotations

import ast
import operator
import re

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_CALL = re.compile(r"<calc>\s*([^<]*?)\s*(?:</calc>|$)", re.DOTALL)


def evaluate(expression: str):
    """The value of an arithmetic expression; ValueError for anything else."""
    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = walk(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](left, right)
        raise ValueError("only numbers, + - * / // % ** and parentheses are allowed")

    try:
        tree = ast.parse(expression.replace("×", "*").replace("^", "**").strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression!r}") from None
    value = walk(tree)
    return int(value) if isinstance(value, float) and value.is_integer() else value


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "347 * 589"
    """
    return str(evaluate(expression))


class Calculator:
    """The plain-text protocol: ``<calc>expression</calc>`` in a turn is answered with ``Result: <value>``
    (or ``Error: ...``); a turn without a call ends the episode."""

    def reset(self, row):
        self.calls = 0
        return None

    def step(self, text: str):
        found = _CALL.findall(text)
        if not found:
            return None
        self.calls += 1
        try:
            return f"Result: {evaluate(found[-1])}"
        except (ValueError, ZeroDivisionError, OverflowError) as e:
            return f"Error: {e}"


def python(code: str) -> str:
    """Run a short Python program of arithmetic and return what it prints.

    Args:
        code: assignments, print() calls and arithmetic on numbers, e.g. "x = 347 * 589\nprint(x)"
    """
    return run_arithmetic(code)


def run_arithmetic(code: str) -> str:
    """What ``code`` prints (the value of a last bare expression too, as a REPL shows it), run by walking its syntax
    tree: assignments to names, print() of numbers, strings and f-strings, arithmetic as `evaluate` allows it;
    ``import`` lines are skipped. ValueError for anything else (no ``eval``, no loops, no functions)."""
    try:
        tree = ast.parse(code)
    except SyntaxError as e:
        raise ValueError(f"the code is not valid Python (line {e.lineno})") from None
    names, out = {}, []
    for k, stmt in enumerate(tree.body):
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(stmt, ast.Assign) and all(isinstance(t, ast.Name) for t in stmt.targets):
            value = _value(stmt.value, names)
            names.update({t.id: value for t in stmt.targets})
        elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) and getattr(stmt.value.func, "id", "") \
                == "print" and not stmt.value.keywords:
            out.append(" ".join(_text(a, names) for a in stmt.value.args))
        elif isinstance(stmt, ast.Expr) and k == len(tree.body) - 1:
            out.append(_text(stmt.value, names))
        else:
            raise ValueError(f"line {stmt.lineno}: only assignments, print() and arithmetic are supported")
    return "\n".join(out) if out else "(nothing was printed)"


def _value(node, names: dict):
    """A number: `evaluate`'s arithmetic over constants and the names assigned so far."""
    if isinstance(node, ast.Name):
        if node.id not in names:
            raise ValueError(f"name {node.id!r} is not defined")
        return names[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _value(node.left, names), _value(node.right, names)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large")
        return _OPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _value(node.operand, names)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    raise ValueError(f"line {node.lineno}: only numbers, names, + - * / // % ** and parentheses are allowed")


def _text(node, names: dict) -> str:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(_text(v.value if isinstance(v, ast.FormattedValue) else v, names) for v in node.values)
    value = _value(node, names)
    return str(int(value) if isinstance(value, float) and value.is_integer() else value)
