"""materl sweep: real trials (materl train processes on the tiny model), Optuna's samplers and
pruners, Ctrl-C and resume with a real SIGINT, and search-space errors naming the key."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytest.importorskip("optuna")

from materl.errors import ConfigError  # noqa: E402
from materl.runtime.sweep import JOURNAL, STUDY, load_sweep, run_sweep  # noqa: E402

BASE = {
    "model": {"name": "tiny-random"}, "recipe": "grpo",
    "rewards": [{"name": "length", "weight": 0.5, "params": {"target": 6}}, {"name": "diversity", "weight": 0.5}],
    "data": {"source": "arithmetic", "train_size": 16, "test_size": 2},
    "compile": {"group_size": 2, "max_new_tokens": 6, "lr": 1e-4},
    "train": {"steps": 2, "batch_size": 2, "eval_every": 1, "save_every": 1, "keep_last": 1},
    "logging": {"progress": False, "tensorboard": False},
}


def write(tmp_path: Path, sweep: dict, **train) -> Path:
    data = json.loads(json.dumps(BASE))
    data["train"].update(train)
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"sweep": {"dir": str(tmp_path / "s"), **sweep}, **data}))
    return path


def metric_values(run_dir: Path, metric: str) -> dict[int, float]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if metric in rec:
            out[rec["step"]] = rec[metric]
    return out


def study(tmp_path: Path):
    import optuna

    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(tmp_path / "s" / JOURNAL)))
    return optuna.load_study(study_name=STUDY, storage=storage)


def test_grid_sweep_runs_every_point_as_a_train_run(tmp_path):
    path = write(tmp_path, {"sampler": "grid", "pruner": "none", "parallel": 2,
                            "space": {"compile.lr": [1e-4, 1e-3]}})
    result = run_sweep(path, say=lambda _: None)
    rows = result["trials"]
    assert sorted(r["params"]["compile.lr"] for r in rows) == [1e-4, 1e-3]
    for r in rows:  # a normal run dir; the value is the metric's last reported value
        run_dir = Path(r["run_dir"])
        assert r["state"] == "complete" and (run_dir / "checkpoints").is_dir()
        evals = metric_values(run_dir, "eval/reward")
        assert sorted(evals) == [0, 1, 2] and r["value"] == evals[2]
        assert yaml.safe_load((run_dir / "config.yaml").read_text())["compile"]["lr"] == r["params"]["compile.lr"]
    assert "eval/reward" in result["compare"] and Path(result["plot"]).is_file()


def test_pruned_trials_stop_early(tmp_path):
    # the per-step lr is known in advance: Optuna's ThresholdPruner rejects lr < 5e-4 at its first report
    path = write(tmp_path, {"sampler": "grid", "pruner": "threshold", "pruner_params": {"lower": 5e-4},
                            "metric": "lr", "direction": "maximize", "space": {"compile.lr": [1e-4, 1e-3]}},
                 steps=6, eval_every=0, save_every=0)
    rows = {r["params"]["compile.lr"]: r for r in run_sweep(path, say=lambda _: None)["trials"]}
    assert rows[1e-3]["state"] == "complete" and rows[1e-3]["value"] == 1e-3 and rows[1e-3]["steps"] == 6
    assert rows[1e-4]["state"] == "pruned" and rows[1e-4]["steps"] == 1  # reported once, then rejected


def test_the_example_sweep_tpe_with_median_pruning(tmp_path):
    """examples/configs/tiny_sweep.yaml, made smaller: Optuna's TPE and MedianPruner on eval/reward."""
    example = Path(__file__).resolve().parents[2] / "examples" / "configs" / "tiny_sweep.yaml"
    result = run_sweep(example, ["train.steps=2", "data.train_size=16"], sweep_overrides=[
        f"sweep.dir={tmp_path / 's'}", "sweep.n_trials=3", "sweep.pruner_params.n_startup_trials=1",
        "sweep.pruner_params.n_warmup_steps=0"], say=lambda _: None)
    rows = result["trials"]
    assert len(rows) == 3 and {r["state"] for r in rows} <= {"complete", "pruned"}
    assert rows[0]["state"] == "complete"  # the pruner's startup trial
    for r in rows:
        assert 1e-5 <= r["params"]["compile.lr"] <= 1e-2 and r["params"]["compile.group_size"] in (2, 4)
        evals = metric_values(Path(r["run_dir"]), "eval/reward")
        if r["state"] == "complete":  # every evaluation reported; the value is the last one
            assert r["value"] == evals[max(evals)] and r["steps"] == len(evals) == 3
        else:  # reported up to the step the pruner rejected it at; Optuna keeps that value
            assert r["value"] in evals.values() and r["steps"] <= len(evals)
    assert result["best"]["value"] == max(r["value"] for r in rows if r["state"] == "complete")


@pytest.mark.parametrize("space, message", [
    ({"compile.lrr": [1e-4]}, "sweep.space.compile.lrr"),
    ({"compile.lr": {"low": 1e-3}}, "sweep.space.compile.lr: a range takes low, high"),
    ({"compile.lr": "fast"}, "sweep.space.compile.lr: expected a list of choices or a range"),
    ({"train.run_dir": ["a"]}, "sweep.space.train.run_dir: the sweep sets"),
    ({"compile.group_size": [0, 2]}, "sweep.space.compile.group_size=0"),
])
def test_bad_search_space_names_the_key(tmp_path, space, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        load_sweep(write(tmp_path, {"sampler": "random", "n_trials": 2, "space": space}))


def test_grid_needs_lists_and_eval_metrics_need_evaluations(tmp_path):
    with pytest.raises(ConfigError, match=r"sweep\.space\.compile\.lr: the grid sampler needs a list"):
        load_sweep(write(tmp_path, {"sampler": "grid", "space": {"compile.lr": {"low": 1e-5, "high": 1e-3}}}))
    with pytest.raises(ConfigError, match="train.eval_every=0"):
        load_sweep(write(tmp_path, {"sampler": "grid", "space": {"compile.lr": [1e-4]}}, eval_every=0))


def test_ctrl_c_then_resume(tmp_path):
    """A real SIGINT to a running ``materl sweep``: it stops its trial cleanly (exit 130); the same
    command then keeps the finished trial and resumes the interrupted one from its checkpoint."""
    path = write(tmp_path, {"sampler": "grid", "pruner": "none", "space": {"compile.lr": [1e-4, 1e-3]}},
                 steps=20, eval_every=5, save_every=2)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "materl.cli", "sweep", str(path)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    second = tmp_path / "s" / "trial_001" / "checkpoints"
    deadline = time.monotonic() + 300
    while not (second.is_dir() and any(second.glob("step-*"))) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    assert "interrupted" in out
    states = {t.number: t.state.name for t in study(tmp_path).trials}
    assert states == {0: "COMPLETE", 1: "RUNNING"}, out
    first_log = (tmp_path / "s" / "trial_000" / "metrics.jsonl").read_text()

    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    trials = study(tmp_path).trials
    assert [t.state.name for t in trials] == ["COMPLETE", "FAIL", "COMPLETE"]  # 1 interrupted, retried as 2
    assert trials[2].system_attrs["failed_trial"] == 1 and trials[2].user_attrs["run_dir"].endswith("trial_001")
    assert (tmp_path / "s" / "trial_000" / "metrics.jsonl").read_text() == first_log  # not rerun
    resumed = yaml.safe_load((tmp_path / "s" / "trial_001" / "config.yaml").read_text())
    assert resumed["train"]["resume"] is True
    evals = metric_values(tmp_path / "s" / "trial_001", "eval/reward")
    assert sorted(evals) == [0, 5, 10, 15, 20] and trials[2].value == evals[20]
    assert "trial 1 was interrupted" in done.stdout


def test_trials_on_a_ray_cluster(tmp_path):
    """backend: ray: each trial's process is started by a Ray actor (a local cluster here)."""
    pytest.importorskip("ray")
    path = write(tmp_path, {"sampler": "grid", "pruner": "none", "parallel": 2, "backend": "ray",
                            "space": {"compile.group_size": [2, 4]}}, steps=1)
    result = run_sweep(path, say=lambda _: None)
    assert sorted(r["params"]["compile.group_size"] for r in result["trials"]) == [2, 4]
    for r in result["trials"]:
        evals = metric_values(Path(r["run_dir"]), "eval/reward")
        assert r["state"] == "complete" and r["value"] == evals[1]
    import ray

    assert not ray.is_initialized()  # the cluster the sweep started is shut down
