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


def _calc_rollout(results, answer: str):
    from materl.rollout.types import Rollout, Step, ToolCall

    steps = [Step("generate", [1, 2], [-0.1, -0.2], tool_calls=[ToolCall("calculate", {"expression": "2+3"})],
                  finish_reason="tool_call")]
    if results:
        steps.append(Step("tool", [3, 4], tool_results=results))
    steps.append(Step("generate", [5], [-0.3], text=f"<answer>{answer}</answer>", finish_reason="stop"))
    return Rollout(prompt_ids=[0], steps=steps)


def test_the_score_via_the_tool_counts_a_right_answer_only_with_a_call_that_worked():
    sys.path.insert(0, str(ROOT / "examples"))
    from materl.rollout.types import ToolResult
    from materl.runtime.reasoning_tasks import reasoning_gym_score
    from reasoning_gym_curriculum import reasoning_gym_via_tool

    ok, err = ToolResult("calculate", "5"), ToolResult("calculate", "bad expression", is_error=True)
    entry = {"question": "2 + 3 =", "answer": "5", "metadata": {"source_dataset": "basic_arithmetic"}}
    rollouts = [_calc_rollout([ok], "5"),        # right, through a call that worked -> 1
                _calc_rollout([], "5"),          # right from memory, no result -> 0
                _calc_rollout([err], "5"),       # right, but the only call failed -> 0
                _calc_rollout([err, ok], "5"),   # one of two calls worked -> 1
                _calc_rollout([ok], "6")]        # wrong through the tool -> the task's score of "6"
    batch = dict(completions=[r.text for r in rollouts], rg_entry=[entry] * 5)
    plain = reasoning_gym_score(**batch)
    assert plain[:4] == [1.0] * 4 and plain[4] < 1.0
    assert reasoning_gym_via_tool(**batch, rollouts=rollouts) == [1.0, 0.0, 0.0, 1.0, plain[4]]


def test_require_tool_trains_the_score_via_the_tool_and_keeps_the_plain_score_at_weight_zero(tmp_path):
    sys.path.insert(0, str(ROOT / "examples"))
    import materl as ml
    import reasoning_gym_curriculum

    task = ml.ReasoningGymTask("basic_arithmetic", seed=3, shots=0, instruction=None)
    assert reasoning_gym_curriculum.ToolPrompted(task, require_tool=True).score_key == "reward/reasoning_gym_via_tool"
    with pytest.raises(ValueError, match="require_tool needs tools=True"):
        reasoning_gym_curriculum.build(task, model="tiny-random", group_size=2, max_new_tokens=4, lr=0.0, seed=0,
                                       require_tool=True)
    result = reasoning_gym_curriculum.run(model="tiny-random", steps=2, batch_size=2, group_size=2, max_new_tokens=6,
                                          lr=1e-3, test_size=2, run_dir=str(tmp_path), tools=True, require_tool=True,
                                          curriculum=ml.Curriculum(window=2, pool_size=8))
    for h in result["history"]:
        assert {"reward/reasoning_gym/mean", "reward/reasoning_gym_via_tool/mean", "curriculum/pass_rate"} <= set(h)
        # the total is the score via the tool + 0.2 x tool_success: the plain score has weight 0
        expected = h["reward/reasoning_gym_via_tool/mean"] + 0.2 * h["reward/tool_success/mean"]
        assert abs(h["reward"] - expected) <= 1e-6 * max(1.0, abs(expected)), h
