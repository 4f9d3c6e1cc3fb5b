"""reasoning-gym tasks as datasets: seeded rows, knobs, the task's own scorer as a reward, clear
errors, and runs through the config, train_rlhf and the tool recipe (real reasoning_gym, the
tiny random model)."""

import json

import pytest

import materl as ml
from materl.errors import ConfigError, UnknownNameError
from materl.ops.rewards import REWARDS
from materl.runtime.config import validate_config
from materl.runtime.reasoning_tasks import REWARD, ReasoningGymTask, reasoning_gym_score, task_names


def test_rows_are_seeded_and_the_split_is_disjoint():
    task = ReasoningGymTask("basic_arithmetic", seed=5)
    assert task.rows(4) == ReasoningGymTask("basic_arithmetic", seed=5).rows(4)
    assert task.rows(4) != task.rows(4, seed=6)
    train, test = task.split(40, 8)
    assert len(train) == 40 and len(test) == 8
    assert not {r["rg_entry"]["question"] for r in train} & {r["rg_entry"]["question"] for r in test}
    row = train[0]
    assert row["prompt"].endswith("\n\nGive only the final answer between <answer> and </answer>.")
    assert row["prompt"].startswith(row["rg_entry"]["question"]) and row["answer"] == row["rg_entry"]["answer"]
    assert row["rg_entry"]["metadata"]["source_dataset"] == "basic_arithmetic"


def test_levels_set_every_knob_from_the_tasks_own_curriculum():
    task = ReasoningGymTask("basic_arithmetic")
    # reasoning-gym's BasicArithmeticCurriculum declares these two ranges
    assert task.knobs == {"num_terms": [2, 3, 4, 5, 6], "num_digits": [1, 2, 3, 4]} and task.levels == 5
    # level L: each range from its first value to its L-th (the last where it has fewer), reasoning-gym's
    # INCLUSIVE mode: level 2 -> 2..4 terms, 1..3 digits; level 4 -> 2..6 terms, 1..4 digits
    for level, terms, digits in ((0, (2, 2), (1, 1)), (2, (2, 4), (1, 3)), (4, (2, 6), (1, 4))):
        for row in task.rows_at(level, 6, seed=1):
            meta = row["rg_entry"]["metadata"]
            assert tuple(meta["difficulty"]["num_terms"]) == terms and tuple(meta["difficulty"]["num_digits"]) == digits
            assert terms[0] <= meta["num_terms"] <= terms[1] and digits[0] <= meta["num_digits"] <= digits[1]
    fixed = ReasoningGymTask("basic_arithmetic", level=0, options={"operators": ["+"]})
    expressions = [r["rg_entry"]["metadata"]["expression"] for r in fixed.rows(8)]
    assert all(" + " in e and not {"*", "/"} & set(e) for e in expressions), expressions


def test_shots_put_worked_examples_before_the_question():
    task = ReasoningGymTask("basic_arithmetic", seed=4, shots=2)
    plain = ReasoningGymTask("basic_arithmetic", seed=4)
    row, bare = task.rows_at(1, 1, seed=9)[0], plain.rows_at(1, 1, seed=9)[0]
    examples = plain.rows(2, seed=6, level=1)  # the worked examples come from stream seed + 2, at the row's level
    assert row["prompt"] == [
        {"role": "user", "content": examples[0]["prompt"]},
        {"role": "assistant", "content": f"<answer>{examples[0]['answer']}</answer>"},
        {"role": "user", "content": examples[1]["prompt"]},
        {"role": "assistant", "content": f"<answer>{examples[1]['answer']}</answer>"},
        {"role": "user", "content": bare["prompt"]}]
    assert row["rg_entry"] == bare["rg_entry"]
    with pytest.raises(ConfigError, match=r"shots=-1; accepted: an integer >= 0"):
        ReasoningGymTask("basic_arithmetic", shots=-1)


def test_the_tasks_scorer_is_the_reward():
    entry = ReasoningGymTask("basic_arithmetic", seed=2).rows(1)[0]["rg_entry"]
    gold = entry["answer"]
    completions = [f"I think <answer>{gold}</answer>", f"<answer>{int(gold) + 1}</answer>", gold,
                   f"<answer>1</answer> then <answer>{gold}</answer>"]
    # right; wrong; no tags (scored as no answer); the last tagged answer counts
    assert reasoning_gym_score(completions=completions, rg_entry=[entry] * 4) == [1.0, 0.0, 0.0, 1.0]
    assert REWARDS.get(REWARD) is reasoning_gym_score


def test_bad_names_options_and_levels_are_clear_errors():
    with pytest.raises(UnknownNameError, match=r"unknown reasoning-gym task 'basic_arithmetik' \(did you mean "
                                               r"'basic_arithmetic'\?\); \d+ tasks: .*leg_counting"):
        ReasoningGymTask("basic_arithmetik")
    with pytest.raises(ConfigError, match=r"no option 'max_term' \(did you mean 'max_terms'\?\); its options: "
                                          r"min_terms=2, max_terms=6"):
        ReasoningGymTask("basic_arithmetic", options={"max_term": 3})
    with pytest.raises(ConfigError, match=r"refuses options \{'min_terms': 5, 'max_terms': 3\}: max_terms must be >= "
                                          r"min_terms"):
        ReasoningGymTask("basic_arithmetic", options={"min_terms": 5, "max_terms": 3})
    with pytest.raises(ConfigError, match=r"level=5 .* accepted: 0..4"):
        ReasoningGymTask("basic_arithmetic", level=5)
    with pytest.raises(ConfigError, match=r"options 'max_terms' are set by its difficulty knobs at level=1"):
        ReasoningGymTask("basic_arithmetic", options={"max_terms": 3}, level=1)
    assert "basic_arithmetic" in task_names() and len(task_names()) > 50


def test_config_accepts_the_source_and_names_the_field_on_errors():
    cfg = validate_config({"data": {"source": "reasoning_gym:basic_arithmetic", "level": 1,
                                    "params": {"operators": ["+", "-"]}}})
    assert cfg.data.level == 1
    with pytest.raises(UnknownNameError, match=r"data.source 'reasoning_gym:nope' \(config\): unknown reasoning-gym task"):
        validate_config({"data": {"source": "reasoning_gym:nope"}})
    with pytest.raises(ConfigError, match=r"data.level / data.curriculum need a dataset with difficulty knobs"):
        validate_config({"data": {"source": "arithmetic", "level": 1}})
    with pytest.raises(ConfigError, match=r"data.level=1 fixes the difficulty and data.curriculum moves it"):
        validate_config({"data": {"source": "reasoning_gym:basic_arithmetic", "level": 1, "curriculum": {}}})


def _tiny(tmp_path, **kw):
    return ml.train_rlhf("tiny-random", dataset="reasoning_gym:basic_arithmetic", steps=2, batch_size=2, test_size=2,
                         eval_every=2, run_dir=str(tmp_path), use_mojo=False, group_size=2, max_new_tokens=4,
                         lr=1e-3, **kw)


def test_train_rlhf_scores_with_the_task_and_names_it_in_metrics(tmp_path):
    result = _tiny(tmp_path / "a", dataset_options={"operators": ["+"]}, level=0)
    assert "reward/reasoning_gym/mean" in result["final"] and result["final"]["reward"] == \
        result["final"]["reward/reasoning_gym/mean"]  # the task's scorer replaced grpo's placeholder rewards
    assert "eval/accuracy" in result["evals"][-1] and "eval/reward/reasoning_gym" in result["evals"][-1]
    saved = (tmp_path / "a" / "checkpoints" / "step-000002" / "config.yaml").read_text()
    assert "reasoning_gym:basic_arithmetic" in saved


def test_the_tool_recipe_trains_on_a_task_with_the_calculator(tmp_path):
    result = _tiny(tmp_path / "tools", algorithm="grpo_tools", tools=["python -m materl.tools.calculator"],
                   reward_functions=["reasoning_gym", ("tool_success", 0.2)], level=0)
    final = result["final"]
    assert {"reward/reasoning_gym/mean", "reward/tool_success/mean", "tool_calls"} <= set(final)


def test_curriculum_from_train_rlhf_reports_level_and_pass_rate(tmp_path):
    result = _tiny(tmp_path / "c", curriculum={"window": 2, "pool_size": 8, "eval_level": 1})
    assert result["final"]["curriculum/level"] == 0.0 and "curriculum/pass_rate" in result["final"]
    records = [json.loads(x) for x in (tmp_path / "c" / "metrics.jsonl").read_text().splitlines()]
    assert sum("curriculum/level" in r for r in records) == 2
