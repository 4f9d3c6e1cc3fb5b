"""examples/text_rewards_rl.py runs in CI on the tiny model: two GRPO steps rewarded by the
sentiment and toxicity rewards; every episode's reward terms are those of its completion text."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import materl as ml
from materl.ops import text_rewards as T

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import text_rewards_rl  # noqa: E402


def test_the_example_trains_two_steps_on_the_tiny_model():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "examples/text_rewards_rl.py"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line.split() for line in out.stdout.splitlines() if line.startswith("step ")]
    assert [x[1] for x in lines] == ["0", "1"]
    for x in lines:
        reward, sentiment, toxicity = float(x[3]), float(x[5]), float(x[7])
        assert -1 <= sentiment <= 1 and -1 <= toxicity <= 0
        assert reward == pytest.approx(0.7 * sentiment + 0.3 * toxicity, abs=1e-3)


def test_each_episode_is_scored_on_its_completion_text():
    step = ml.compile(text_rewards_rl.friendly_grpo, policy=ml.Agent("tiny-random", trainable=True),
                      ref_policy=ml.Agent("tiny-random"), group_size=2, max_new_tokens=8, seed=0)
    step.run(prompts=text_rewards_rl.PROMPTS[:2])
    for e in step.last_episodes:
        text = step.episode_rollout(e).text
        assert e.metrics["reward/sentiment"] == pytest.approx(T.sentiment(completions=[text])[0], abs=1e-6)
        assert e.metrics["reward/toxicity"] == pytest.approx(T.toxicity(completions=[text])[0], abs=1e-6)
    step.close()
