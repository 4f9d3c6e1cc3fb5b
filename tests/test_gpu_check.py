"""benchmarks/gpu_check.py, the prepared GPU check, in its CPU smoke mode (tiny shapes), so the
script that runs on the GPU machine does not rot between the rare runs there."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_prints_every_section(tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--dry-run", "--skip", "trl", "scale", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = proc.stdout.split("## materl GPU check", 1)[1]
    for row in ("decode | tiny batch 2 x 4: HF generate eager |", "decode | tiny batch 2 x 4: materl transformers engine |",
                "grpo | tiny: materl fp32 |", "learner | tiny: cuda_graphs=True | skipped: needs CUDA"):
        assert row in summary, summary
    assert "failed:" not in summary, summary
    assert out.read_text().count("tok/s") == 3
