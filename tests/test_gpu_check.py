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
    for row in ("decode | tiny batch 2 x 4: HF generate eager |", "decode | tiny batch 2 x 4: materl current loop |",
                "decode | tiny batch 2 x 4: materl device loop (graph) |",
                "decode | tiny batch 2 x 4: materl device loop (compile) |",
                "decode | tiny batch 4 x 4: materl device loop (graph) |",
                "agentic | tiny 4 x 3 turns, 10 ms tool: materl device loop (graph) |",
                "agentic | tiny 4 x 3 turns, 10 ms tool: materl current loop |",
                "grpo | tiny: materl fp32 |", "learner | tiny: cuda_graphs=True | skipped: needs CUDA"):
        assert row in summary, summary
    assert "failed:" not in summary, summary
    # 4 decode rows at batch 2, 3 at batch 4, the compile row, 2 agentic rows
    assert out.read_text().count("tok/s") == 10
    # every later turn of the device loop prefilled exactly its new tokens (tool result + template
    # + the last sampled token): the earlier turns' keys and values were kept
    agentic = next(line for line in summary.splitlines() if "agentic" in line and "device loop" in line)
    assert "(1.000x)" in agentic, agentic


def test_junit_failures_carry_the_assertion_and_traceback(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from gpu_check import junit_failures
    finally:
        sys.path.pop(0)
    test = tmp_path / "test_fails.py"
    test.write_text("def test_ok():\n    pass\n\ndef test_bad():\n    x = 2\n    assert x == 3, 'x was off'\n")
    junit = tmp_path / "junit.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", str(test), "-p", "no:cacheprovider", f"--junitxml={junit}"],
                   cwd=tmp_path, capture_output=True, text=True, timeout=120)
    [(name, message, trace)] = junit_failures(junit)
    assert name.endswith("test_bad") and "x was off" in message
    assert "assert x == 3" in trace
