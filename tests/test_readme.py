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


def _readme_commands() -> list[str]:
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = re.findall(r"```bash\n(.*?)```", text, re.S)[0]
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_readme_commands_install_through_the_lock_and_ci_runs_the_test_command():
    demo, tests = _readme_commands()
    for cmd in (demo, tests):
        assert cmd.startswith("pip install torch==2.13.0 && pip install -c constraints.txt -e ")
    assert '".[mojo]"' in demo and demo.endswith("python examples/calculator_tool_rl.py")
    assert '".[dev,mojo]"' in tests and tests.endswith("python -m pytest -q -ra -n 2 --dist loadgroup")
    ci = (Path(__file__).resolve().parents[1] / ".ci" / "run").read_text()
    assert f"pytest_rc bash -c '{tests}'" in ci  # CI runs the README's test command verbatim


def test_the_lock_pins_every_dependency_exactly():
    root = Path(__file__).resolve().parents[1]
    pins = [line for line in (root / "constraints.txt").read_text().splitlines() if line and not line.startswith("#")]
    assert pins and all(re.fullmatch(r"[A-Za-z0-9._-]+==[A-Za-z0-9.+!-]+", p) for p in pins), pins
    names = {p.split("==")[0].lower().replace("_", "-") for p in pins}
    for needed in ("torch", "transformers", "mcp", "anyio", "mojo", "pytest", "ray", "wandb", "mlflow-skinny", "trl"):
        assert needed in names, needed


def test_readme_tools_block_runs(capsys):
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text.split("## Tools you can train against", 1)[1]
    code = re.findall(r"```python\n(.*?)```", section, re.S)[0]
    exec(compile(code, "README.md", "exec"), {"__name__": "readme_tools"})  # our own documentation
    # the calculator answers 6 * 7; episode "a" deposits twice into its Ledger, episode "b" once into its own
    assert capsys.readouterr().out.splitlines() == ["['calc.calculate', 'deposit']", "42", "['5', '10', '5']"]


def test_readme_says_how_to_get_a_cpu_torch():
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "Python >= 3.11" in text and "python3 -m venv" in text
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in text
