"""Calculator MCP server: one tool, ``calculate(expression)``, exact integer arithmetic.

    python -m materl.tools.calculator              # stdio
    python -m materl.tools.calculator --http 8765  # streamable HTTP on 127.0.0.1:8765/mcp

The expression is parsed with ``ast.parse(mode="eval")`` and walked over a whitelist: int and
float literals, ``+ - * / // % **``, unary ``+ -`` and parentheses. Nothing is ever passed to
``eval``/``exec``; a name, attribute, call, subscript, comparison or string is refused with a
message that says what was found. Limits: 1000 characters, integers up to 100,000 bits during
the computation, results up to 4,300 digits (Python's own int-to-str limit), finite floats.
"""

from __future__ import annotations

import ast
import math
import operator

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations

try:  # run as ``python tools/calculator.py`` from a checkout as well as ``-m materl.tools...``
    from materl.tools._serve import main as _serve_main
except ImportError:  # pragma: no cover
    from _serve import main as _serve_main  # type: ignore[no-redef]

MAX_CHARS = 1000
MAX_BITS = 100_000
MAX_DIGITS = 4300
ALLOWED = "numbers and + - * / // % ** ( )"

_BINOPS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNOPS = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_REFUSED = {
    ast.Name: "names", ast.Attribute: "attributes", ast.Call: "function calls",
    ast.Subscript: "subscripts", ast.Compare: "comparisons", ast.BoolOp: "boolean operators",
    ast.Lambda: "lambdas", ast.IfExp: "conditional expressions",
}


class CalcError(ValueError):
    """The expression is not valid arithmetic or breaks a limit; the message says which."""


def evaluate(expression: str) -> int | float:
    """Value of an arithmetic ``expression``; raises ``CalcError`` with a readable reason."""
    if not isinstance(expression, str):
        raise CalcError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_CHARS:
        raise CalcError(f"expression has {len(expression)} characters; the limit is {MAX_CHARS}")
    if not expression.strip():
        raise CalcError(f"expression is empty; write {ALLOWED}")
    shown = repr(expression) if len(expression) <= 60 else repr(expression[:57] + "...")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        hint = " (use ** for powers)" if "^" in expression else ""
        raise CalcError(f"cannot parse {shown}: {exc.msg}{hint}") from None
    except (RecursionError, MemoryError, ValueError):
        raise CalcError(f"cannot parse {shown}: it is nested too deeply") from None
    try:
        return _eval(tree.body, expression)
    except RecursionError:
        raise CalcError(f"{shown} is nested too deeply") from None


def _eval(node: ast.AST, src: str) -> int | float:
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise CalcError(f"only numbers are allowed, got {value!r}; write {ALLOWED}")
        return value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNOPS:
        return _UNOPS[type(node.op)](_eval(node.operand, src))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval(node.left, src), _eval(node.right, src)
        return _apply(node.op, left, right)
    segment = ast.get_source_segment(src.strip(), node) or type(node).__name__
    what = _REFUSED.get(type(node))
    if what is None:
        op = getattr(node, "op", None)
        what = f"the operator {type(op).__name__}" if op is not None else f"{type(node).__name__} expressions"
        if isinstance(op, ast.BitXor):
            what += " (^ is bitwise xor; use ** for powers)"
    raise CalcError(f"{what} are not allowed (found {segment!r}); write {ALLOWED}")


def _apply(op: ast.operator, a: int | float, b: int | float) -> int | float:
    if isinstance(a, int) and isinstance(b, int):
        _check_int_size(op, a, b)
    try:
        value = _BINOPS[type(op)](a, b)
    except ZeroDivisionError:
        raise CalcError("division by zero") from None
    except OverflowError:
        raise CalcError("the result is too large for a float") from None
    if isinstance(value, complex):
        raise CalcError(f"{a!r} ** {b!r} is a complex number; only real results are supported")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalcError("the result is too large for a float (it overflows to infinity)")
    return value


def _check_int_size(op: ast.operator, a: int, b: int) -> None:
    """Refuse integer work whose result would pass ``MAX_BITS`` before doing it."""
    if isinstance(op, ast.Pow) and b > 0 and abs(a) > 1:
        bits = (abs(a).bit_length() - 1) * b  # a lower bound on the result's bit length
        if bits > MAX_BITS:
            raise CalcError(f"{a} ** {b} has more than {MAX_BITS} bits; the limit is {MAX_BITS} bits")
    if isinstance(op, ast.Mult) and a.bit_length() + b.bit_length() > MAX_BITS + 1:
        raise CalcError(f"the product has more than {MAX_BITS} bits; the limit is {MAX_BITS} bits")


def format_result(value: int | float) -> str:
    """Exact text of a result: every digit of an int, the shortest round-trip repr of a float."""
    if isinstance(value, int):
        digits = int(value.bit_length() * math.log10(2)) + 1
        if digits > MAX_DIGITS:
            raise CalcError(f"the result has about {digits} digits; the limit is {MAX_DIGITS}")
        return str(value)
    return repr(value)


app = MCPServer("calculator", instructions="Exact arithmetic on numbers.", log_level="WARNING")


@app.tool(annotations=ToolAnnotations(read_only_hint=True, idempotent_hint=True, open_world_hint=False))
def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression exactly and return the result.

    Supports integers (of any size) and decimals, + - * / // % ** and parentheses,
    e.g. "(17 + 5) * 3 ** 2" -> "198". Names, functions and other Python are refused.
    """
    try:
        return format_result(evaluate(expression))
    except CalcError as exc:
        raise ToolError(str(exc)) from None


if __name__ == "__main__":
    _serve_main(app, "materl calculator MCP server")
