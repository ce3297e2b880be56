"""A safe arithmetic calculator tool: the expression is parsed with ``ast`` and only number literals, + - * / // % **,
unary signs and parentheses are evaluated. Nothing is ``eval``-ed, no name, call or attribute is ever looked up."""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable

from miles.rollout.tools import Tool

# Bounds that keep one call cheap: a 200-character expression with exponents <= 100 on values <= 1e100 costs
# microseconds, while 9 ** 9 ** 9 alone would take minutes and gigabytes.
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 100
MAX_ABS_VALUE = 10**100

_BINARY: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[float], float]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def evaluate_arithmetic(expression: str) -> int | float:
    """The value of an arithmetic expression: int and float literals, ``+ - * / // % **``, unary ``+ -`` and
    parentheses (Python's precedence). ``^`` is not power (it is refused, as in Python it is XOR).

    >>> evaluate_arithmetic("814 * 707 - 965")
    574533
    >>> evaluate_arithmetic("(1 + 2) / 4")
    0.75

    Raises: ValueError (with a message meant for the model) for anything else: names, calls, attributes, other
        operators, bool or complex literals, syntax errors, more than 200 characters, an exponent above 100 in
        magnitude, a value above 1e100 in magnitude or not finite, division by zero.
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression has {len(expression)} characters; at most {MAX_EXPRESSION_CHARS} are allowed")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ValueError(f"{expression!r} is not an arithmetic expression ({err.msg})") from None
    return _evaluate(tree.body)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise ValueError(f"only numbers are allowed, not {node.value!r}")
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _checked(_UNARY[type(node.op)](_evaluate(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"the exponent {right} is too large (at most {MAX_EXPONENT} in magnitude)")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError("the result is too large") from None
        if isinstance(value, complex):  # a negative base to a fractional power
            raise ValueError("the result is not a real number")
        return _checked(value)
    raise ValueError(f"{ast.unparse(node)!r} is not allowed: use numbers, + - * / // % ** and parentheses")


def _checked(value: int | float) -> int | float:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("the result is not a finite number")
    if abs(value) > MAX_ABS_VALUE:
        raise ValueError("the result is too large (above 1e100 in magnitude)")
    return value


def format_number(value: int | float) -> str:
    """A result as the model sees it: integers (and integral floats) without a decimal point, other floats with 12
    significant digits.

    >>> format_number(6 / 3), format_number(2 / 3), format_number(-7)
    ('2', '0.666666666667', '-7')
    """
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return format(value, ".12g") if isinstance(value, float) else str(value)


def calculate(expression: str) -> str:
    """The calculator tool's function: ``format_number(evaluate_arithmetic(expression))``. Raises: ValueError."""
    if not isinstance(expression, str):
        raise ValueError(f'"expression" must be a string, e.g. "12 * 34", not {expression!r}')
    return format_number(evaluate_arithmetic(expression))


calculator = Tool(
    name="calculator",
    description="Evaluate an arithmetic expression (numbers, + - * / // % **, parentheses) and return its value.",
    parameters={
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "The expression, e.g. 814 * 707 - 965"}},
        "required": ["expression"],
    },
    fn=calculate,
)
