"""Early stopping: the rule by hand, then a real run that stops, keeps its best checkpoint
through keep_last pruning, names it, and resumes its counting from a checkpoint."""

import json

import pytest

import materl as ml
from materl.cli import main
from materl.errors import ConfigError
from materl.recipes import grpo
from materl.runtime.checkpoint import best_checkpoint
from materl.runtime.early_stop import EarlyStopping
from materl.runtime.tasks import arithmetic_rows
from materl.runtime.train import train


def test_max_mode_with_min_delta_and_patience():
    es = EarlyStopping(metric="accuracy", patience=2, min_delta=0.05)
    assert es.metric == "eval/accuracy"
    assert es.update(0, {"eval/accuracy": 0.10}) and es.best_step == 0  # the first sets the best
    assert es.update(10, {"eval/accuracy": 0.20})  # 0.20 > 0.10 + 0.05
    assert not es.update(20, {"eval/accuracy": 0.24})  # 0.24 is not > 0.25: not an improvement
    assert es.bad_evals == 1 and not es.should_stop
    assert not es.update(30, {"eval/accuracy": 0.10})
    assert es.should_stop and es.best == 0.20 and es.best_step == 10


def test_min_mode_and_state_round_trip():
    es = EarlyStopping(metric="eval/completion_tokens", mode="min", patience=1)
    assert es.update(0, {"eval/completion_tokens": 30.0})
    assert es.update(5, {"eval/completion_tokens": 29.0})  # smaller is better
    assert not es.update(10, {"eval/completion_tokens": 29.0}) and es.should_stop
    again = EarlyStopping(metric="eval/completion_tokens", mode="min", patience=1)
    again.load_state_dict(json.loads(json.dumps(es.state_dict())))
    assert (again.best, again.best_step, again.bad_evals) == (29.0, 5, 1)


def test_stop_at_stops_on_reaching_the_target_in_either_mode():
    es = EarlyStopping(metric="accuracy", patience=5, stop_at=0.75)
    assert es.update(0, {"eval/accuracy": 0.5}) and not es.should_stop
    assert es.update(1, {"eval/accuracy": 0.74}) and not es.should_stop  # an improvement, short of the target
    assert es.update(2, {"eval/accuracy": 0.75}) and es.should_stop and es.bad_evals == 0  # >= the target
    low = EarlyStopping(metric="eval/loss", mode="min", patience=5, stop_at=0.1)
    assert low.update(0, {"eval/loss": 0.2}) and not low.should_stop
    assert low.update(1, {"eval/loss": 0.1}) and low.should_stop  # <= the target in min mode
    again = EarlyStopping(metric="eval/loss", mode="min", patience=5, stop_at=0.1)
    again.load_state_dict(json.loads(json.dumps(low.state_dict())))
    assert again.should_stop and again.best == 0.1


def test_bad_settings_and_an_unknown_metric_are_clear_errors():
    with pytest.raises(ConfigError, match=r"mode='best'.*max, min"):
        EarlyStopping(mode="best")
    with pytest.raises(ConfigError, match=r"patience=0"):
        EarlyStopping(patience=0)
    with pytest.raises(ConfigError, match=r"min_delta=-0.1"):
        EarlyStopping(min_delta=-0.1)
    with pytest.raises(ConfigError, match=r"stop_at=nan"):
        EarlyStopping(stop_at=float("nan"))
    with pytest.raises(ConfigError, match=r"eval/acuracy.*step 4.*eval/accuracy, eval/reward"):
        EarlyStopping(metric="acuracy").update(4, {"eval/accuracy": 0.5, "eval/reward": 1.0})


def _step():
    recipe = ml.replace(grpo, "rewards", lambda g: ml.reward("exact_match"))
    return ml.compile(recipe, policy=ml.Agent("tiny-random", trainable=True), ref_policy=ml.Agent("tiny-random"),
                      group_size=2, max_new_tokens=4, lr=1e-3, seed=0)


def test_a_run_stops_after_patience_and_keeps_the_best_checkpoint(tmp_path):
    rows = arithmetic_rows(8, seed=1)
    step = _step()
    try:  # the random model never answers: eval/accuracy is 0 at every evaluation, so step 0 stays best
        result = train(step, rows, steps=6, batch_size=2, eval_dataset=rows[:2], eval_every=1, save_every=1,
                       keep_last=1, run_dir=tmp_path, progress=False, tensorboard=False,
                       early_stopping=EarlyStopping(metric="eval/accuracy", patience=2))
    finally:
        step.close()
    assert result["stopped_at"] == 2 and len(result["history"]) == 2  # evals at 1 and 2 did not beat 0
    assert [e["step"] for e in result["evals"]] == [0, 1, 2]
    names = sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*"))
    assert names == ["step-000000", "step-000002"]  # keep_last=1 pruned step 1, not the best
    assert result["best_checkpoint"] == str(tmp_path / "checkpoints" / "step-000000")
    assert best_checkpoint(tmp_path).name == "step-000000"
    assert result["checkpoint"].endswith("step-000002")
    assert json.loads((tmp_path / "checkpoints" / "step-000002" / "state.json").read_text())[
        "data_state"]["early_stopping"] == {"best": 0.0, "best_step": 0, "bad_evals": 2, "reached": False}


def test_resume_counts_on_from_the_checkpoint(tmp_path):
    rows = arithmetic_rows(8, seed=1)
    kw = dict(batch_size=2, eval_dataset=rows[:2], eval_every=1, save_every=1, run_dir=tmp_path, progress=False,
              tensorboard=False)
    step = _step()
    try:
        first = train(step, rows, steps=1, early_stopping=EarlyStopping(patience=2), **kw)
    finally:
        step.close()
    assert first["stopped_at"] is None  # one evaluation without improvement (step 1), patience 2
    step = _step()
    try:  # resumed: one more evaluation without improvement is the second in a row
        second = train(step, rows, steps=5, resume=tmp_path, early_stopping=EarlyStopping(patience=2), **kw)
    finally:
        step.close()
    assert second["stopped_at"] == 2 and second["best_checkpoint"].endswith("step-000000")


def test_early_stopping_needs_evaluations():
    step = _step()
    try:
        with pytest.raises(ConfigError, match=r"early_stopping \(eval/accuracy\) needs evaluations.*eval_every=0"):
            train(step, arithmetic_rows(4), steps=2, early_stopping=EarlyStopping(), progress=False)
    finally:
        step.close()


def test_cli_flags_turn_it_on(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", "examples/configs/tiny_grpo.yaml", "--set", f"train.run_dir={run_dir}",
                 "--set", "train.steps=5", "--set", "train.eval_every=1", "--set", "rewards=[{name: exact_match}]",
                 "--early-stopping", "eval/accuracy",
                 "--patience", "1", "--min-delta", "0.01"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stopped_at"] == 1 and out["best_checkpoint"].endswith("step-000000")
    assert main(["train", "examples/configs/tiny_grpo.yaml", "--set", f"train.run_dir={run_dir}",
                 "--patience", "2"]) == 2
    assert "early_stopping needs evaluations" in capsys.readouterr().err


def test_stop_at_met_by_the_start_trains_nothing(tmp_path, capsys):
    run_dir = tmp_path / "run"  # the random model's accuracy is 0 from the start: <= 0 in min mode
    assert main(["train", "examples/configs/tiny_grpo.yaml", "--set", f"train.run_dir={run_dir}",
                 "--set", "train.steps=5", "--set", "train.eval_every=1", "--set", "rewards=[{name: exact_match}]",
                 "--set", "train.early_stopping.mode=min", "--stop-at", "0"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stopped_at"] == 0 and out["best_checkpoint"].endswith("step-000000")
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")) == ["step-000000"]
