"""User code named in a config (rewards, recipes as ``module:attribute``) through the real
``materl`` console script, and runs whose episodes keep failing: they stop, loudly, non-zero."""

import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

import materl as ml
from materl.errors import StepFailedError
from materl.recipes import grpo
from materl.runtime.checkpoint import load_checkpoint
from materl.runtime.tasks import arithmetic_rows
from materl.runtime.train import train

ROOT = Path(__file__).resolve().parents[2]
MATERL = Path(sys.executable).with_name("materl")  # the console script installed with the package


def tiny_config(folder: Path, **changes) -> Path:
    cfg = yaml.safe_load((ROOT / "examples/configs/tiny_grpo.yaml").read_text())
    cfg["train"].update(steps=2, run_dir=str(folder / "run"))
    for key, value in changes.items():
        cfg[key] = value
    path = folder / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def materl_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(MATERL), *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_console_script_finds_rewards_and_recipes_next_to_the_config(tmp_path):
    config_dir, elsewhere = tmp_path / "experiment", tmp_path / "elsewhere"
    config_dir.mkdir(), elsewhere.mkdir()
    (config_dir / "my_rewards.py").write_text(textwrap.dedent("""
        def short(*, completions, **_):
            return [1.0 / (1 + len(c)) for c in completions]
    """))
    (config_dir / "my_recipes.py").write_text(textwrap.dedent("""
        import materl as ml
        from materl.recipes import grpo
        mine = ml.replace(grpo, "rewards", lambda g: ml.reward("length", target=3))
    """))
    path = tiny_config(config_dir, recipe="my_recipes:mine", rewards=[{"name": "my_rewards:short"}])
    out = materl_cli("train", str(path), cwd=elsewhere)  # neither module is on sys.path or in the cwd
    assert out.returncode == 0, out.stderr[-3000:]
    final = json.loads(out.stdout)["final"]
    assert final["step"] == 2 and "reward/short/mean" in final


def test_console_script_reports_a_missing_module_before_training(tmp_path):
    path = tiny_config(tmp_path, rewards=[{"name": "nowhere_module:fn"}])
    out = materl_cli("train", str(path), cwd=tmp_path)
    assert out.returncode == 2
    assert "rewards[0].name='nowhere_module:fn': no module 'nowhere_module' on sys.path" in out.stderr
    assert not (tmp_path / "run").exists()  # nothing ran


def test_recipes_command_knows_every_recipe_a_config_accepts(tmp_path):
    out = materl_cli("recipes", cwd=tmp_path)
    assert out.returncode == 0 and "grpo_tools" in out.stdout.split()
    out = materl_cli("recipes", "grpo_tools", cwd=tmp_path)
    assert out.returncode == 0 and "call_tools(%turn_1) {tools=Toolbox(calculator)}" in out.stdout
    (tmp_path / "factories.py").write_text(textwrap.dedent("""
        from materl.recipes.grpo_tools import grpo_tools_recipe
        def tool_grpo(toolbox):
            return grpo_tools_recipe(toolbox, turns=3)
    """))
    out = materl_cli("recipes", "factories:tool_grpo", "--tool", "python -m materl.tools.calculator", cwd=tmp_path)
    assert out.returncode == 0 and "%turn_3 = generate_step" in out.stdout, out.stderr
    out = materl_cli("recipes", "factories:tool_grpo", cwd=tmp_path)
    assert out.returncode == 2 and "is a recipe factory, which takes the run's Toolbox" in out.stderr


def test_a_reward_that_always_raises_stops_the_run_at_step_1_non_zero(tmp_path):
    (tmp_path / "bad_rewards.py").write_text(textwrap.dedent("""
        def always_raises(*, completions, **_):
            raise KeyError("solution")  # (a reward whose missing column is a keyword fails at load instead)
    """))
    path = tiny_config(tmp_path, rewards=[{"name": "bad_rewards:always_raises"}])
    out = materl_cli("train", str(path), cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    err = out.stderr.splitlines()
    first = next(line for line in err if line.startswith("materl train: error:"))
    assert "step 1: 4 of 4 episodes failed" in first
    detail = next(line for line in err if line.startswith("  4 x RewardError in node 'rewards'"))
    assert "solution" in detail
    assert not list((tmp_path / "run").glob("**/state.json"))  # no checkpoint of a step that failed


def calls_then_fail(n_ok: int):
    """A reward that works for its first ``n_ok`` calls and then raises on every episode."""
    calls = {"n": 0}

    def flaky(*, completions, **_):
        calls["n"] += 1
        if calls["n"] > n_ok:
            raise RuntimeError("the reward service went away")
        return [0.5] * len(completions)

    return flaky


def test_a_run_that_starts_failing_keeps_its_last_good_checkpoint(tmp_path):
    step = ml.compile(ml.replace(grpo, "rewards", lambda g: ml.reward(calls_then_fail(1))),
                      policy=ml.Agent("tiny-random", trainable=True), ref_policy=ml.Agent("tiny-random"),
                      group_size=2, max_new_tokens=4, lr=1e-3)
    # the step's 4 episodes reach the rewards node together: one batched call per step, then it fails
    with pytest.raises(StepFailedError, match="step 2: 4 of 4 episodes failed"):
        train(step, arithmetic_rows(8, seed=0), steps=5, batch_size=2, save_every=1, run_dir=tmp_path,
              progress=False, tensorboard=False)
    step.close()
    assert load_checkpoint(tmp_path).step == 1  # the run dir's latest: step 1's, intact and loadable
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1]


def test_below_the_threshold_each_kind_of_failure_is_logged_once_and_counted(tmp_path, caplog):
    def one_bad(*, completions, prompts, **_):
        if any(p.startswith("What is 0") for p in prompts):
            raise ValueError("cannot score this one")
        return [0.0] * len(completions)

    rows = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(4)]
    step = ml.compile(ml.replace(grpo, "rewards", lambda g: ml.reward(one_bad)),
                      policy=ml.Agent("tiny-random", trainable=True), ref_policy=ml.Agent("tiny-random"),
                      group_size=2, max_new_tokens=4, lr=1e-3, max_failed_fraction=0.5)
    with caplog.at_level(logging.WARNING, logger="materl"):
        result = train(step, rows, steps=3, batch_size=4, shuffle=False, run_dir=tmp_path, progress=False,
                       tensorboard=False)
    step.close()
    counts = [h["failures/rewards/RewardError"] for h in result["history"]]
    assert counts == [2.0, 2.0, 2.0]  # prompt 0's two episodes, every step
    logged = [r for r in caplog.records if "episode failed" in r.getMessage()]
    assert len(logged) == 1 and "cannot score this one" in logged[0].getMessage()
