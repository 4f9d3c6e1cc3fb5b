"""``materl compare``: the final and best value of each metric runs share (best by the metric's
direction), one overlaid plot, and clear errors for a folder that is not a run."""

import json
import shutil
import subprocess
import sys

import pytest

import materl as ml
from materl.cli import main
from materl.errors import ConfigError, RunNotFoundError
from materl.recipes import grpo
from materl.runtime.compare import compare, direction, draw_comparison, load_runs
from materl.runtime.tasks import arithmetic_split
from materl.runtime.train import train


def write_run(folder, records):
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


@pytest.fixture
def two_runs(tmp_path):
    # run a: reward 0.2, 0.8, 0.5 -> final 0.5, best (max) 0.8 at step 2
    #        loss   1.0, 0.4, 0.6 -> final 0.6, best (min) 0.4 at step 2
    # run b: reward 0.1, 0.3, 0.9 -> final = best 0.9 at step 3; loss 0.9, 0.7, 0.2 -> final = best 0.2 at step 3
    # eval/accuracy (steps 0 and 3): a 0.25 -> 0.75, b 0.5 -> 0.5 (a tie: the first step is the best)
    a = write_run(tmp_path / "runs" / "a", [
        {"step": 0, "eval/accuracy": 0.25},
        {"step": 1, "reward": 0.2, "loss": 1.0, "lr": 1e-4, "only_a": 1.0},
        {"step": 2, "reward": 0.8, "loss": 0.4, "lr": 1e-4},
        {"step": 3, "reward": 0.5, "loss": 0.6, "lr": 1e-4},
        {"step": 3, "eval/accuracy": 0.75},
    ])
    b = write_run(tmp_path / "runs" / "b", [
        {"step": 0, "eval/accuracy": 0.5},
        {"step": 1, "reward": 0.1, "loss": 0.9, "lr": 3e-4},
        {"step": 2, "reward": 0.3, "loss": 0.7, "lr": 3e-4},
        {"step": 3, "reward": 0.9, "loss": 0.2, "lr": 3e-4},
        {"step": 3, "eval/accuracy": 0.5},
    ])
    return a, b


def table_rows(out: str) -> dict[str, list[str]]:
    lines = out.splitlines()
    return {line.split()[0]: line.split()[1:] for line in lines[1:] if not line.startswith("plot: ")}


def test_direction_follows_the_documented_rule():
    up = ["reward", "reward/answer/mean", "eval/reward", "eval/reward/answer", "eval/accuracy", "dpo_loss/accuracy",
          "tool_success", "eval/tool_success", "tokens_per_s"]
    down = ["loss", "loss/policy_loss", "dpo_loss", "time/step", "time/node/rewards", "failed_episodes", "eval/failed",
            "failures/rewards/RuntimeError"]
    none = ["reward/std", "reward/answer/std", "episodes", "tokens", "lr", "kl", "entropy", "grad_norm",
            "policy_loss/clipfrac", "policy_loss/kl", "tool_calls"]
    assert [direction(m) for m in up] == ["max"] * len(up)
    assert [direction(m) for m in down] == ["min"] * len(down)
    assert [direction(m) for m in none] == [None] * len(none)


def test_table_has_final_and_best_of_the_common_metrics(two_runs, tmp_path, capsys):
    a, b = two_runs
    out_png = tmp_path / "plots" / "ab.png"
    assert main(["compare", str(a), str(b), "--out", str(out_png)]) == 0
    out = capsys.readouterr().out
    # runs headed by the shortest end of their paths that tells them apart
    assert out.splitlines()[0].split() == ["metric", "a", "final", "a", "best", "b", "final", "b", "best"]
    rows = table_rows(out)
    # the default rows: the shaping metrics the runs share (lr is not one; only_a is not in both)
    assert list(rows) == ["reward", "loss", "eval/accuracy"]
    assert rows["reward"] == ["0.5", "0.8", "@2", "0.9", "0.9", "@3"]
    assert rows["loss"] == ["0.6", "0.4", "@2", "0.2", "0.2", "@3"]
    assert rows["eval/accuracy"] == ["0.75", "0.75", "@3", "0.5", "0.5", "@0"]
    assert out.splitlines()[-1] == f"plot: {out_png}" and out_png.read_bytes()[:4] == b"\x89PNG"
    # every shared metric on request
    assert main(["compare", str(a), str(b), "--metrics", "all", "--out", str(out_png)]) == 0
    rows = table_rows(capsys.readouterr().out)
    assert list(rows) == ["eval/accuracy", "loss", "lr", "reward"]
    assert rows["lr"] == ["0.0001", "-", "0.0003", "-"]  # a setting has no best


def test_columns_option_and_labels(two_runs, tmp_path, capsys):
    a, b = two_runs
    assert main(["compare", str(a), str(b), "--columns", "first,mean", "--metrics", "reward",
                 "--out", str(tmp_path / "c.png")]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["metric", "a", "first", "a", "mean", "b", "first", "b", "mean"]
    # a: first 0.2, mean (0.2 + 0.8 + 0.5) / 3 = 0.5; b: first 0.1, mean (0.1 + 0.3 + 0.9) / 3 = 0.4333
    assert table_rows(out)["reward"] == ["0.2", "0.5", "0.1", "0.4333"]
    with pytest.raises(ConfigError, match=r"unknown column\(s\) worst; valid: final, best, first, mean"):
        compare([a, b], columns=["final", "worst"])
    # two runs with one folder name keep their parents
    seed_a = write_run(tmp_path / "x" / "seed0", [{"step": 1, "reward": 0.1}])
    seed_b = write_run(tmp_path / "y" / "seed0", [{"step": 1, "reward": 0.2}])
    table, _ = compare([seed_a, seed_b], out=tmp_path / "s.png")
    assert table.splitlines()[0].split() == ["metric", "x/seed0", "final", "x/seed0", "best", "y/seed0", "final",
                                             "y/seed0", "best"]


def test_identical_curves_stay_visible(two_runs, tmp_path):
    a, _ = two_runs
    same = tmp_path / "same"
    shutil.copytree(a, same)
    fig = draw_comparison(load_runs([a, same]), ["reward"])
    first, second = fig.axes[0].get_lines()
    assert first.get_xydata().tolist() == second.get_xydata().tolist()  # the same values...
    # ...drawn so that both show: another dash pattern and marker, narrower, on top, hollow
    assert (first.get_linestyle(), first.get_marker()) != (second.get_linestyle(), second.get_marker())
    assert first.get_linewidth() > second.get_linewidth() and first.get_markersize() > second.get_markersize()
    assert second.get_zorder() > first.get_zorder() and second.get_markerfacecolor() == "none"


def test_metrics_option_picks_rows_and_panels(two_runs, tmp_path, capsys, monkeypatch):
    a, b = two_runs
    monkeypatch.chdir(tmp_path)
    assert main(["compare", str(a), str(b), "--metrics", "reward, eval/*"]) == 0
    out = capsys.readouterr().out
    assert list(table_rows(out)) == ["reward", "eval/accuracy"]  # in the order asked
    assert out.splitlines()[-1] == "plot: compare.png" and (tmp_path / "compare.png").exists()  # the default path
    fig = draw_comparison(load_runs([a, b]), ["reward", "eval/accuracy"])
    drawn = {ax.get_ylabel(): {line.get_label(): line.get_xydata().tolist() for line in ax.get_lines()}
             for ax in fig.axes}
    assert drawn["reward"] == {str(a): [[1, 0.2], [2, 0.8], [3, 0.5]], str(b): [[1, 0.1], [2, 0.3], [3, 0.9]]}
    assert drawn["eval/accuracy"] == {str(a): [[0, 0.25], [3, 0.75]], str(b): [[0, 0.5], [3, 0.5]]}
    with pytest.raises(ConfigError, match=r"--metrics 'only_a' matches no metric that every run has; "
                                          r"common metrics: eval/accuracy, loss, lr, reward"):
        compare([a, b], metrics=["only_a"])


def test_runs_without_common_metrics_or_plot_panels(two_runs, tmp_path, capsys):
    a, _ = two_runs
    other = write_run(tmp_path / "other", [{"step": 1, "entropy": 6.2}])
    with pytest.raises(ConfigError, match="the runs have no metric in common"):
        compare([a, other])
    with pytest.raises(ConfigError, match="given more than once"):
        compare([a, a])
    # lr alone has a table row but is none of the default plot's metrics: nothing is drawn
    only_lr = write_run(tmp_path / "only_lr", [{"step": 1, "lr": 0.1}, {"step": 2, "lr": 0.05}])
    assert main(["compare", str(only_lr), "--out", str(tmp_path / "none.png")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split() == ["lr", "0.05", "-"] and out[-1].startswith("plot: none")
    assert not (tmp_path / "none.png").exists()


def test_a_folder_that_is_not_a_run_exits_2(two_runs, tmp_path, capsys):
    a, _ = two_runs
    assert main(["compare", str(a), str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"materl compare: error: run dir '{tmp_path / 'missing'}' does not exist")
    (tmp_path / "not_a_run").mkdir()
    (tmp_path / "not_a_run" / "notes.txt").write_text("x")
    assert main(["compare", str(a), str(tmp_path / "not_a_run")]) == 2
    assert "has no metrics.jsonl (it holds: notes.txt)" in capsys.readouterr().err
    write_run(tmp_path / "torn", []).joinpath("metrics.jsonl").write_text('{"step": 1, "rew')
    with pytest.raises(RunNotFoundError, match="holds no record"):
        load_runs([tmp_path / "torn"])
    # the console entry point, as a user runs it
    proc = subprocess.run([sys.executable, "-m", "materl.cli", "compare", str(a), str(tmp_path / "missing")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "does not exist" in proc.stderr and "Traceback" not in proc.stderr


def test_a_real_run_against_itself(tmp_path, capsys):
    train_rows, held_out = arithmetic_split(8, 2, seed=0)
    step = ml.compile(grpo, policy=ml.Agent("tiny-random", trainable=True), ref_policy=ml.Agent("tiny-random"),
                      group_size=2, max_new_tokens=4, lr=1e-3)
    result = train(step, train_rows, steps=2, batch_size=2, eval_dataset=held_out, eval_every=2,
                   run_dir=tmp_path / "real", progress=False, tensorboard=False)
    step.close()
    shutil.copytree(tmp_path / "real", tmp_path / "copy")
    assert main(["compare", str(tmp_path / "real"), str(tmp_path / "copy"), "--metrics", "all",
                 "--out", str(tmp_path / "c.png")]) == 0
    rows = table_rows(capsys.readouterr().out)
    history = result["history"]
    for run in (0, 1):  # final = the last step's value; best = max (reward) / min (loss) over the steps
        assert float(rows["reward"][3 * run]) == pytest.approx(history[-1]["reward"], rel=1e-3)
        assert float(rows["reward"][3 * run + 1]) == pytest.approx(max(h["reward"] for h in history), rel=1e-3)
        assert float(rows["loss"][3 * run + 1]) == pytest.approx(min(h["loss"] for h in history), rel=1e-3, abs=1e-4)
    assert {"reward/length/mean", "reward/diversity/mean", "eval/reward", "time/step"} <= set(rows)
    fig = draw_comparison(load_runs([tmp_path / "real"]), ["reward", "reward/length/mean", "loss", "eval/reward"])
    assert [ax.get_ylabel() for ax in fig.axes] == ["reward", "reward/length/mean", "loss", "eval/reward"]
