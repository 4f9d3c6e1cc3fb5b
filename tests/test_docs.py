"""Every code block in docs/ runs, so the guide cannot drift from the code.

Per page, in document order, in a fresh temporary working directory (with ``examples/`` linked
into it) and a fresh namespace:

- ``python`` blocks are executed (our own documentation, never model output);
- ``bash`` blocks run line by line as subprocesses: ``materl ...`` through the installed console
  script, ``python ...`` with this interpreter; any other command needs a skip marker;
- ``yaml`` blocks are validated as (partial) training configs;
- a ``text`` block preceded by ``<!-- docs-test: output -->`` must appear in the output of the
  block before it (a line ``...`` stands for any lines).

``<!-- docs-test: skip (reason) -->`` right before a block leaves it out; the reason is
required, and shown in the page itself, so a skipped block is visible to every reader.
``<!-- docs-test: needs mojo -->`` runs a block only where the ``mojo`` package is installed
(and ``MATERL_DISABLE_MOJO`` unset), as ``@pytest.mark.mojo`` tests do.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
BLOCK = re.compile(r"(?:<!--\s*docs-test:\s*(?P<directive>.*?)\s*-->[ \t]*\n)?^```(?P<lang>[\w-]*)[ \t]*\n"
                   r"(?P<body>.*?)^```[ \t]*$", re.S | re.M)
SHELL_TIMEOUT_S = 300
LANGS = ("python", "bash", "yaml", "text")


@dataclass
class Block:
    page: str
    line: int  # 1-based line of the block's first code line
    lang: str
    body: str
    directive: str | None

    @property
    def where(self) -> str:
        return f"docs/{self.page}:{self.line}"

    @property
    def skip_reason(self) -> str | None:
        if self.directive is None or self.directive == "output":
            return None
        if self.directive == "needs mojo":
            return None if has_mojo() else "the mojo package is not installed"
        m = re.fullmatch(r"skip \((.+)\)", self.directive)
        if not m:
            raise AssertionError(f"{self.where}: unknown docs-test directive {self.directive!r}; "
                                 f"accepted: 'skip (reason)', 'needs mojo', 'output'")
        return m.group(1)


def has_mojo() -> bool:
    from materl.kernels import loader

    return importlib.util.find_spec("mojo") is not None and not loader.disabled()


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    out = []
    for m in BLOCK.finditer(text):
        line = text.count("\n", 0, m.start("body")) + 1
        out.append(Block(page.name, line, m.group("lang"), m.group("body"), m.group("directive")))
    return out


def test_every_page_has_blocks_and_every_block_a_language():
    assert [p.name for p in PAGES] == ["agents.md", "checkpoints-and-export.md", "concepts.md", "configs-and-cli.md",
                                       "environments.md", "gpu.md", "index.md", "kernels.md", "off-policy.md", "recipes.md",
                                       "reward-shaping.md", "scaling-out.md", "scaling-up.md",
                                       "tool-use.md"]
    for page in PAGES:
        found = blocks(page)
        assert found, f"docs/{page.name} has no code blocks"
        assert text_fences(page) == len(found), f"docs/{page.name}: a fence did not parse as a block"
        for b in found:
            assert b.lang in LANGS, f"{b.where}: a code block's language must be one of {LANGS}, got {b.lang!r}"
            _ = b.skip_reason  # an unknown directive fails here
            if b.directive == "output":
                assert b.lang == "text", f"{b.where}: 'output' marks a text block"


def text_fences(page: Path) -> int:
    return sum(1 for line in page.read_text().splitlines() if line.startswith("```")) // 2


def test_relative_links_resolve():
    for page in [*PAGES, ROOT / "README.md"]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.name}: link to {target!r} does not resolve"
    readme = (ROOT / "README.md").read_text()
    for page in PAGES:
        assert f"docs/{page.name}" in readme, f"README.md does not link docs/{page.name}"


def test_compile_options_table_matches_the_code():
    """concepts.md lists every compile option once, with its default as the code has it."""
    from materl.compiler.options import CompileOptions

    text = (DOCS / "concepts.md").read_text().split("### Compile options", 1)[1].split("\n## ", 1)[0]
    table = dict(re.findall(r"^\| `(\w+)` \| `(.*?)` \|", text, re.M))
    defaults = CompileOptions()
    names = sorted(getattr(CompileOptions, "model_fields", None) or defaults.__dataclass_fields__)
    names = [n for n in names if not n.startswith("_")]
    assert sorted(table) == names
    for name in names:
        assert table[name] == repr(getattr(defaults, name)), f"compile option {name}: docs say {table[name]}"


def test_config_reference_lists_every_key_with_its_default():
    """configs-and-cli.md's "Every key and its default" block is TrainConfig's defaults (the
    compile section is documented by the compile options table)."""
    from materl.runtime.config import TrainConfig

    text = (DOCS / "configs-and-cli.md").read_text().split("### Every key and its default", 1)[1]
    documented = yaml.safe_load(re.search(r"```yaml\n(.*?)```", text, re.S).group(1))
    defaults = TrainConfig().model_dump(mode="json")
    documented.pop("compile"), defaults.pop("compile")
    assert documented == defaults


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("page", PAGES, ids=[p.stem for p in PAGES])
def test_page_code_runs(page, workdir):
    namespace: dict = {"__name__": f"docs_{page.stem.replace('-', '_')}"}
    previous_output: str | None = None
    previous_skipped = False
    try:
        for b in blocks(page):
            if b.skip_reason is not None:
                previous_output, previous_skipped = None, True
                continue
            if b.lang == "text":
                if b.directive == "output" and not previous_skipped:
                    assert previous_output is not None, f"{b.where}: 'output' block follows no executed block"
                    assert_output(b, previous_output)
                continue
            previous_skipped = False
            if b.lang == "python":
                previous_output = run_python(b, namespace)
            elif b.lang == "bash":
                previous_output = run_shell(b, workdir)
            elif b.lang == "yaml":
                check_yaml(b)
                previous_output = None
    finally:
        close_compiled(namespace)


def run_python(b: Block, namespace: dict) -> str:
    code = compile("\n" * (b.line - 1) + b.body, str(DOCS / b.page), "exec")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(code, namespace)  # noqa: S102 - the repository's own documentation
    sys.stdout.write(out.getvalue())
    return out.getvalue()


def shell_commands(body: str) -> list[str]:
    commands, pending = [], ""
    for raw in body.splitlines():
        line = raw.rstrip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = (pending + line).strip()
        pending = ""
        if line and not line.startswith("#"):
            commands.append(line.split(" #", 1)[0].strip())
    return commands


def run_shell(b: Block, cwd: Path) -> str:
    bindir = Path(sys.executable).parent
    env = {**os.environ, "MODULAR_TELEMETRY_ENABLED": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"}
    output = []
    for command in shell_commands(b.body):
        argv = shlex.split(command)
        if argv[0] == "materl":
            argv[0] = str(bindir / "materl")
        elif argv[0] in ("python", "python3"):
            argv[0] = sys.executable
        else:
            raise AssertionError(f"{b.where}: the test runs only `materl` and `python` commands; mark this block "
                                 f"<!-- docs-test: skip (reason) --> to show {argv[0]!r}")
        proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=SHELL_TIMEOUT_S)
        assert proc.returncode == 0, (f"{b.where}: `{command}` exited {proc.returncode}\n"
                                      f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}")
        output.append(proc.stdout)
    return "".join(output)


def check_yaml(b: Block) -> None:
    from materl.runtime.config import validate_config

    data = yaml.safe_load(b.body)
    assert isinstance(data, dict), f"{b.where}: a yaml block holds config sections"
    validate_config(data, where=b.where)


def assert_output(b: Block, output: str) -> None:
    """The block's text appears in ``output``, in order; a line ``...`` skips any lines."""
    lines = [ln.rstrip() for ln in output.splitlines()]
    chunks: list[list[str]] = [[]]
    for ln in b.body.rstrip("\n").splitlines():
        if ln.strip() == "...":
            chunks.append([])
        else:
            chunks[-1].append(ln.rstrip())
    pos = 0
    for chunk in (c for c in chunks if c):
        for start in range(pos, len(lines) - len(chunk) + 1):
            if lines[start:start + len(chunk)] == chunk:
                pos = start + len(chunk)
                break
        else:
            raise AssertionError(f"{b.where}: expected output not found:\n" + "\n".join(chunk) +
                                 "\n--- actual output ---\n" + output)


def test_the_checks_themselves_fail_on_a_mismatch():
    """The harness is only as good as its checks: a wrong expected output, an unknown directive,
    an unmarked non-materl command and an unknown config key are all refused."""
    out = "a\nb\nc\nd\n"
    assert_output(Block("x.md", 1, "text", "a\n...\nc\n", "output"), out)
    for wrong in ("b\na\n", "a\nc\n", "e\n", "c\n...\na\n"):
        with pytest.raises(AssertionError, match="expected output not found"):
            assert_output(Block("x.md", 1, "text", wrong, "output"), out)
    with pytest.raises(AssertionError, match="unknown docs-test directive"):
        _ = Block("x.md", 1, "bash", "ls\n", "skip because").skip_reason
    with pytest.raises(AssertionError, match="runs only `materl` and `python`"):
        run_shell(Block("x.md", 1, "bash", "pip install nothing\n", None), ROOT)
    from materl.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown key 'stepz'"):
        check_yaml(Block("x.md", 1, "yaml", "train: {stepz: 3}\n", None))
    commands = shell_commands("# a comment\nmaterl train a.yaml \\\n  --set x=1  # why\nmaterl recipes\n")
    assert [shlex.split(c) for c in commands] == [["materl", "train", "a.yaml", "--set", "x=1"], ["materl", "recipes"]]


def close_compiled(namespace: dict) -> None:
    from materl.compiler.compiled import Compiled

    for value in list(namespace.values()):
        if isinstance(value, Compiled):
            value.close()
