import pytest

from materl.benchmark import compare_implementations
from materl.errors import ConfigError


def test_compare_implementations_prints_a_ratio_table():
    table = compare_implementations("repetition", ["python", "torch"], [4, 8], length=16, repeat=2)
    lines = table.splitlines()
    assert lines[0] == "| repetition | B | T | python | torch | torch vs python |"
    assert len(lines) == 4 and lines[2].startswith("| | 4 | 16 |") and lines[3].endswith("x |")


def test_unknown_op_and_implementation_are_errors():
    with pytest.raises(ConfigError, match="unknown op 'repetiton'"):
        compare_implementations("repetiton")
    with pytest.raises(ConfigError, match="no implementation \\['python'\\]"):
        compare_implementations("policy_loss", ["python"], [2], length=8, repeat=1)
