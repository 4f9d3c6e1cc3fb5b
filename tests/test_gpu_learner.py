"""benchmarks/gpu_learner.py (the GPU check's "scale" rows: 7B / 16k-token fits, packed vs
padded, 8-bit AdamW) in its CPU smoke mode, tiny shapes, so it does not rot between GPU runs."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_learner_dry_run_prints_every_row():
    proc = subprocess.run([sys.executable, "benchmarks/gpu_learner.py", "--dry-run"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = proc.stdout.split("| section | item | result |", 1)[1]
    for row in ("| scale | 7b (tiny): 4 x 256 tokens, full FT, gradient_checkpointing=True, optimizer=adamw_8bit",
                "| scale | 1.5b (tiny): 4 x 256 tokens", "packed vs padded |", "adamw_8bit vs adamw |"):
        assert row in summary, summary
    assert "failed:" not in summary and "skipped:" not in summary, summary
    # the packed and padded steps learn the same loss (to float32 rounding)
    losses = [float(line.split("(loss ")[1].split(")")[0]) for line in summary.splitlines()
              if "32 episodes" in line and "(loss " in line]
    assert len(losses) == 2 and abs(losses[0] - losses[1]) < 1e-5
