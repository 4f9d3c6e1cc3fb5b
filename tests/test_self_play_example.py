"""examples/self_play.py runs in CI on the tiny model (--tiny, in this process so that it pays no
second import of torch): two self-play steps on textarena's TicTacToe, then games of the trained
policy against its starting weights; and one step of the real SmolLM2 (slow)."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("textarena")


def _example():
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import self_play
    finally:
        sys.path.remove(str(ROOT / "examples"))
    return self_play


def test_the_example_trains_two_self_play_steps_on_the_tiny_model(tmp_path, capsys):
    assert _example().main(["--tiny", "--run-dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert [s.split()[1] for s in steps] == ["0", "1"]
    # the tiny model's random bytes are never a move: seat 0 loses every game on its second invalid move
    assert all(" outcome -1.000 " in s and " loss 1.00 invalid 2.00 " in s for s in steps), steps
    summary = json.loads(lines[-1])
    assert summary["game"] == "TicTacToe-v0" and summary["steps"] == 2 and summary["trained_tokens"] > 0
    assert summary["eval_games"] == 4 and summary["wins"] + summary["draws"] + summary["losses"] == 4
    low, high = summary["score_ci95"]
    assert low <= summary["score"] <= high


def test_wilson_interval_by_hand():
    # 8 of 10, z = 1.96: centre (0.8 + 1.96^2 / 20) = 0.99208, half 1.96 * sqrt(0.016 + 0.0096040) = 0.31362,
    # both over 1 + 1.96^2 / 10 = 1.38416: (0.99208 -+ 0.31362) / 1.38416 = 0.49016, 0.94332
    low, high = _example().wilson(8, 10)
    assert low == pytest.approx(0.4902, abs=1e-4) and high == pytest.approx(0.9433, abs=1e-4)
    assert _example().wilson(0, 0) == (0.0, 1.0)


@pytest.mark.slow
def test_one_self_play_step_of_smollm2(tmp_path):
    result = _example().run(steps=1, batch_size=1, group_size=2, max_new_tokens=8, eval_games=2, run_dir=str(tmp_path))
    (h,) = result["history"]
    assert h["episodes"] == 2.0 and h["failed_episodes"] <= 1.0  # seat 1 fails only if it never got to move
    assert result["eval_games"] == 2
