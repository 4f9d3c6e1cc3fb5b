"""examples/distill_calculator.py runs in CI on the tiny models (--tiny): three steps of the
calculator recipe with a tiny teacher's reverse-KL term (ml.with_distillation), and the held-out
evaluation before and after."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_example_distils_three_steps_on_the_tiny_models():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "examples/distill_calculator.py", "--tiny"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line.split() for line in out.stdout.splitlines() if line.startswith("step ")]
    assert [line[1] for line in lines] == ["1", "2", "3"], out.stdout
    # two different random models: the student's reverse KL to the teacher is measured, and non-zero
    assert all(line[4] == "reverse_kl" and float(line[5]) != 0 for line in lines), out.stdout
    assert "held-out accuracy (greedy, 4 questions):" in out.stdout
