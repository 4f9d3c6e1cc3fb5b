"""examples/reasoning_gym_curriculum.py runs in CI on the tiny model (--tiny): two curriculum
steps on reasoning-gym's basic_arithmetic, scored by the task, evaluated at the hardest level;
and one curriculum step of the real SmolLM2 (slow)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_example_trains_two_curriculum_steps_on_the_tiny_model(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "examples/reasoning_gym_curriculum.py", "--tiny", "--run-dir", str(tmp_path)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert [s.split()[1] for s in steps] == ["0", "1"] and all("level 0 pass " in s for s in steps), out.stdout
    summary = json.loads(lines[-1])
    assert summary["task"] == "basic_arithmetic" and summary["hardest_level"] == 4 and summary["steps"] == 2
    assert summary["trained_tokens"] > 0 and 0.0 <= summary["accuracy_after"] <= 1.0
    assert (tmp_path / "plot.png").exists()


@pytest.mark.slow
def test_one_curriculum_step_of_smollm2(tmp_path):
    sys.path.insert(0, str(ROOT / "examples"))
    import materl as ml
    import reasoning_gym_curriculum

    result = reasoning_gym_curriculum.run(steps=1, batch_size=2, group_size=2, max_new_tokens=16, test_size=2,
                                          run_dir=str(tmp_path), curriculum=ml.Curriculum(window=4, pool_size=8))
    (h,) = result["history"]
    assert h["curriculum/level"] == 0.0 and h["episodes"] == 4.0 and "reward/reasoning_gym/mean" in h


def test_tool_prompted_rows_put_two_worked_calculator_calls_before_the_tasks_question():
    sys.path.insert(0, str(ROOT / "examples"))
    import materl as ml
    from reasoning_gym_curriculum import ToolPrompted

    task = ml.ReasoningGymTask("basic_arithmetic", seed=3, shots=0, instruction=None)
    wrapped = ToolPrompted(task)
    assert (wrapped.levels, wrapped.score_key) == (5, "reward/reasoning_gym")
    plain, rows = task.rows_at(2, 3, seed=7), wrapped.rows_at(2, 3, seed=7)
    for p, r in zip(plain, rows):
        *example, question = r["prompt"]
        assert question == {"role": "user", "content": p["prompt"]} and r["rg_entry"] == p["rg_entry"]
        assert [t["role"] for t in example] == ["user", "assistant", "tool", "assistant"] * 2
        calls = [json.loads(t["content"].split("\n")[1]) for t in example if t["role"] == "assistant" and "call" in t["content"]]
        results = [t["content"] for t in example if t["role"] == "tool"]
        assert [c["arguments"]["expression"] for c in calls] == ["-( 12 * 7 ) + 5", "( 8 - 23 ) * -4 + 615"]
        assert results == [str(-(12 * 7) + 5), str((8 - 23) * -4 + 615)]  # the worked results are right
        assert [t["content"] for t in example[3::4]] == ["<answer>-79</answer>", "<answer>675</answer>"]
    with pytest.raises(ValueError, match="shots=0, instruction=None"):
        ToolPrompted(ml.ReasoningGymTask("basic_arithmetic", shots=1))
