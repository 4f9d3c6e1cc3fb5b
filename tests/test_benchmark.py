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


def test_the_reward_shaping_benchmark_runs_a_smoke_configuration(tmp_path):
    # benchmarks/reward_shaping.py end to end on the tiny model: the calculator server, grpo_tools
    # with a GiGPO-credited step reward, evaluations before and after (the figures need SmolLM2)
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from reward_shaping import main

    runs = main(["--model", "tiny-random", "--methods", "gigpo", "--seeds", "0", "--steps", "1",
                 "--eval-questions", "1", "--run-dir", str(tmp_path), "--out", str(tmp_path / "runs.json")])
    assert [(r["method"], r["seed"], [s for s, _ in r["evals"]]) for r in runs] == [("gigpo", 0, [0, 1])]
    assert (tmp_path / "runs.json").exists() and (tmp_path / "gigpo_seed0").is_dir()
