"""The README's recipe + transform + compile example runs as written."""

import re
from pathlib import Path


def test_readme_example_runs():
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    code = re.findall(r"```python\n(.*?)```", text, re.S)[0]
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)  # our own documentation, not model output
    metrics = namespace["metrics"]
    assert metrics["episodes"] == 8 and metrics["failed_episodes"] == 0
    assert "loss/value_loss" in metrics and "%advantages = advantages" in namespace["step"].explain()
    namespace["step"].close()
