import pytest

from materl.rollout.mcp import list_tools
from materl.tools.calculator import MAX_BITS, CalcError, evaluate, format_result


@pytest.mark.parametrize("expression, expected", [
    ("1 + 2 * 3", 7),                   # * binds tighter than +
    ("(1 + 2) * 3", 9),
    ("2 ** 3 ** 2", 512),               # ** is right-associative: 2 ** 9
    ("-2 ** 2", -4),                    # unary minus binds looser than **: -(2 ** 2)
    ("(-2) ** 2", 4),
    ("7 // 2", 3), ("-7 // 2", -4),     # floor division rounds toward -inf
    ("7 % 3", 1), ("-7 % 3", 2),        # sign follows the divisor
    ("7 / 2", 3.5), ("1 / 4 + 0.25", 0.5),
    ("+-+3", -3),
    ("2 ** -1", 0.5),
    ("1e3 * 2", 2000.0),
    ("10 ** 30 + 1", 1000000000000000000000000000001),   # exact big int, no float rounding
])
def test_arithmetic(expression, expected):
    value = evaluate(expression)
    assert value == expected and type(value) is type(expected)


def test_format_exact():
    assert format_result(evaluate("2 ** 100")) == "1267650600228229401496703205376"
    assert format_result(evaluate("0.1 + 0.2")) == "0.30000000000000004"   # shortest round-trip repr
    assert format_result(evaluate("6 / 3")) == "2.0"


@pytest.mark.parametrize("expression, message", [
    ("x + 1", "names are not allowed (found 'x')"),
    ("abs(-1)", "function calls are not allowed (found 'abs(-1)')"),
    ("__import__('os').system('ls')", "function calls are not allowed"),
    ("(1).real", "attributes are not allowed"),
    ("[1][0]", "subscripts are not allowed"),
    ("1 < 2", "comparisons are not allowed"),
    ("'a' * 3", "only numbers are allowed, got 'a'"),
    ("True + 1", "only numbers are allowed, got True"),
    ("1j * 2", "only numbers are allowed, got 1j"),
    ("2 ^ 3", "use ** for powers"),
    ("1 << 100", "the operator LShift"),
    ("lambda: 1", "lambdas are not allowed"),
    ("1 +", "cannot parse"),
    ("", "expression is empty"),
    ("1 / 0", "division by zero"), ("1 // 0", "division by zero"), ("1 % 0", "division by zero"),
    ("(-8) ** 0.5", "complex number"),
    ("1e308 * 10", "overflows to infinity"),
    ("10.0 ** 400", "too large for a float"),
])
def test_refusals(expression, message):
    with pytest.raises(CalcError) as info:
        evaluate(expression)
    assert message in str(info.value)


def test_limits():
    with pytest.raises(CalcError, match="has 1001 characters; the limit is 1000"):
        evaluate("1" * 1001)
    # 2 ** 100000 has 100001 bits (allowed while computing), 2 ** 100001 more than MAX_BITS
    assert evaluate("2 ** 100000") == 2 ** MAX_BITS
    with pytest.raises(CalcError, match="more than 100000 bits"):
        evaluate("2 ** 100001")
    with pytest.raises(CalcError, match="more than 100000 bits"):
        evaluate("9 ** 99999 ** 99")   # refused before the (astronomical) power is attempted
    with pytest.raises(CalcError, match="the product has more than"):
        evaluate("(2 ** 60000) * (2 ** 60000)")
    # 2 ** 20000 has 6021 digits: computable, but too long to print (limit 4300)
    with pytest.raises(CalcError, match="about 6021 digits; the limit is 4300"):
        format_result(evaluate("2 ** 20000"))
    with pytest.raises(CalcError, match=r"cannot parse '\(\(\(.*\.\.\.': too many nested parentheses"):
        evaluate("(" * 400 + "1" + ")" * 400)  # the message shows only the first 57 characters


def test_served_over_stdio_by_module_name():
    [spec] = list_tools("python -m materl.tools.calculator")
    assert spec["function"]["name"] == "calculate"
    assert spec["function"]["parameters"]["required"] == ["expression"]
