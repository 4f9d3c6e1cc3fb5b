"""examples/openai_agent_rl.py runs in CI on the tiny model (--tiny): two training steps of an
OpenAI-client agent with its own MCP calculator, rewarded by an exact-answer check and a judge."""

import os
import subprocess
import sys
from pathlib import Path

from materl.rollout.types import Rollout

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import openai_agent_rl  # noqa: E402


def test_exact_answer_reads_the_last_number_of_the_agents_result():
    rollouts = [Rollout([1], metadata={"result": text}) for text in ("5 + 7 = 12", "It is 1,234.", "twelve", None)]
    # last numbers: "12" == "12"; "1,234" -> "1234" == "1234"; none; none
    assert openai_agent_rl.exact_answer(rollouts=rollouts, answer=["12", "1234", "12", "0"]) == [1.0, 1.0, 0.0, 0.0]


def test_the_example_trains_two_steps_on_the_tiny_model():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "examples/openai_agent_rl.py", "--tiny"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["0", "1"]
    # every episode asked the policy at least once, none failed, and the rule judge answered each
    assert all("failed 0" in line and "segments 1.0" in line for line in lines), out.stdout
