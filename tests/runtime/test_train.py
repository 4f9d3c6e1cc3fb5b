"""ml.train: resume equivalence, config-driven runs through the CLI, evaluation."""

import json
from pathlib import Path

import pytest
import torch

import materl as ml
from materl.cli import main
from materl.errors import ConfigError
from materl.recipes import grpo
from materl.runtime.tasks import arithmetic_rows
from materl.runtime.train import train


def make_step():
    return ml.compile(grpo, policy=ml.Agent("tiny-random", trainable=True), ref_policy=ml.Agent("tiny-random"),
                      group_size=2, max_new_tokens=6, lr=1e-3, seed=0)


def test_six_steps_equal_three_plus_resume_plus_three(tmp_path):
    rows = arithmetic_rows(12, seed=1)
    full = make_step()
    a = train(full, rows, steps=6, batch_size=2, run_dir=tmp_path / "full", progress=False, tensorboard=False)
    half = make_step()
    train(half, rows, steps=3, batch_size=2, run_dir=tmp_path / "half", progress=False, tensorboard=False)
    resumed = make_step()  # a fresh process would build the same objects
    b = train(resumed, rows, steps=6, batch_size=2, run_dir=tmp_path / "half", resume=tmp_path / "half",
              progress=False, tensorboard=False)
    keys = ("loss", "reward", "tokens", "grad_norm")
    assert [[h[k] for k in keys] for h in a["history"][3:]] == [[h[k] for k in keys] for h in b["history"]]
    for p, q in zip(full.agents["policy"].parameters(), resumed.agents["policy"].parameters()):
        assert torch.equal(p, q)
    for close in (full, half, resumed):
        close.close()


def test_cli_train_and_eval_on_the_tiny_config(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", "examples/configs/tiny_grpo.yaml", "--set", f"train.run_dir={run_dir}",
                 "--set", "train.eval_every=2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["final"]["step"] == 2.0 and out["evals"][0]["step"] == 0
    assert (run_dir / "metrics.jsonl").exists() and (run_dir / "plot.png").exists()
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("loss" in x for x in lines)
    assert main(["eval", "examples/configs/tiny_grpo.yaml", "--checkpoint", str(run_dir)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["episodes"] == 4.0 and "reward" in result


def test_evaluate_reports_accuracy_and_tool_stats():
    rows = [{"prompt": "Say 7.", "answer": "7"}, {"prompt": "Say 8.", "answer": "8"}]
    result = ml.evaluate(ml.Agent("tiny-random"), rows, ["exact_match", ("length", 0.5, {"target": 4})],
                         max_new_tokens=4)
    assert result["episodes"] == 2.0 and result["accuracy"] == 0.0  # a random model says neither
    assert set(result) >= {"reward", "reward/exact_match", "reward/length", "turns", "tool_calls"}
    assert result["turns"] == 1.0 and result["tool_calls"] == 0.0


def test_train_rlhf_in_one_call(tmp_path):
    rows = [{"prompt": f"Say {i}.", "answer": str(i)} for i in range(6)]
    result = ml.train_rlhf("tiny-random", algorithm="grpo", dataset=rows, reward_functions=[("length", 1.0, {"target": 4})],
                           steps=2, batch_size=2, test_size=2, eval_every=2, run_dir=str(tmp_path / "run"),
                           use_mojo=False, group_size=2, max_new_tokens=4, lr=1e-3)
    assert result["final"]["step"] == 2.0 and result["final"]["episodes"] == 4.0  # 2 prompts x group 2
    assert [e["step"] for e in result["evals"]] == [0, 2]
    assert result["evals"][0]["eval/episodes"] == 2.0  # the 2 held out
    assert Path(result["checkpoint"]).is_dir() and (tmp_path / "run" / "metrics.jsonl").exists()
    # the evaluations are metrics.jsonl's evaluation records: same keys, same values
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert result["evals"] == [r for r in records if any(k.startswith("eval/") for k in r)]


def test_train_rlhf_rejects_bad_values_by_field_before_loading():
    with pytest.raises(ConfigError, match=r"train_rlhf.*recipe"):
        ml.train_rlhf("tiny-random", algorithm="grpoo")
    with pytest.raises(ConfigError, match=r"compile\.group_size"):
        ml.train_rlhf("tiny-random", group_size=0)
    with pytest.raises(ConfigError, match="reward_functions entry"):
        ml.train_rlhf("tiny-random", reward_functions=[3.5])


def test_a_plain_run_prints_no_warnings_or_loading_bars(tmp_path):
    """FutureWarnings (transformers' renamed cache keyword) and "Loading weights" bars are
    noise a user cannot act on; a plain run, with every warning shown, prints neither."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONWARNINGS": "default"}
    out = subprocess.run([sys.executable, "-m", "materl.cli", "train", "examples/configs/tiny_grpo.yaml",
                          "--set", f"train.run_dir={tmp_path}", "--set", "model.lora={r: 4}"],
                         capture_output=True, text=True, env=env, timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Warning" not in out.stderr and "Loading weights" not in out.stderr, out.stderr[-2000:]


def test_logged_lr_is_the_one_each_step_trained_with(tmp_path):
    """linear decay over 3 steps with 1 warmup step: factors 1/1, then 1 - 1/2, then 1 - 2/2."""
    result = train(make_step(), arithmetic_rows(6, seed=0), steps=3, batch_size=2, lr_schedule="linear",
                   warmup_steps=1, run_dir=tmp_path, progress=False, tensorboard=False)
    assert [h["lr"] for h in result["history"]] == pytest.approx([1e-3, 1e-3, 5e-4])


def test_cli_train_runs_the_distributed_section(tmp_path, capsys):
    """distributed: max_staleness and an off-policy correction from the config reach the run."""
    assert main(["train", "examples/configs/tiny_grpo.yaml", "--set", f"train.run_dir={tmp_path / 'run'}",
                 "--set", "train.steps=3", "--set", "distributed.max_staleness=1", "--set", "distributed.deterministic=true",
                 "--set", "distributed.correction={method: tis, cap: 2.0}"]) == 0
    final = json.loads(capsys.readouterr().out)["final"]
    assert final["step"] == 3.0 and final["async/batch_version"] == 1.0 and final["async/staleness_max"] == 1.0
    assert 0.0 < final["policy_loss/is_weight"] <= 2.0 and "mismatch/mean_abs" in final


def test_learner_ranks_must_be_a_positive_int(tmp_path):
    with pytest.raises(ConfigError, match=r"learner_ranks must be an int >= 1, got 0"):
        train(make_step(), arithmetic_rows(4, seed=0), steps=1, batch_size=2, run_dir=tmp_path, progress=False,
              tensorboard=False, learner_ranks=0)
