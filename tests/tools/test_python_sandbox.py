"""The sandbox server over stdio (real subprocesses, real limits). Limits are asserted by the
error the tool returns, never by timing."""

import os
import sys
from pathlib import Path

import pytest
import pytest_asyncio

from materl.rollout.mcp import mcp_tools

ROOT = Path(__file__).resolve().parents[2]
module_loop = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sandbox():
    command = [sys.executable, str(ROOT / "tools/python_sandbox.py"), "--memory-mb", "256"]
    async with mcp_tools(command, timeout_s=30) as tb:
        yield tb


async def run(tb, code, timeout_s=5.0):
    return await tb.call("run_python", {"code": code, "timeout_s": timeout_s})


@module_loop
async def test_runs_code_and_returns_output(sandbox):
    r = await run(sandbox, "import math\nprint(math.factorial(20))\nimport sys; print('warn', file=sys.stderr)")
    assert not r.is_error
    assert r.content == "exit status 0\n--- stdout ---\n2432902008176640000\n--- stderr ---\nwarn"


@module_loop
async def test_exception_is_an_error_with_traceback(sandbox):
    r = await run(sandbox, "def f():\n    return 1 / 0\nf()")
    assert r.is_error and "exit status 1" in r.content
    assert 'File "main.py", line 2, in f' in r.content and "ZeroDivisionError" in r.content


@module_loop
async def test_writes_inside_workdir_only_and_workdir_is_fresh(sandbox):
    r = await run(sandbox, "import os\nprint(os.listdir('.'))\nopen('notes.txt', 'w').write('x')\n"
                           "print(open('notes.txt').read())")
    assert r.content == "exit status 0\n--- stdout ---\n[]\nx"
    again = await run(sandbox, "import os; print(os.listdir('.'))")
    assert "--- stdout ---\n[]" in again.content  # the previous run's file is gone
    target = f"/tmp/materl-sandbox-escape-{os.getpid()}"
    r = await run(sandbox, f"open({target!r}, 'w').write('x')")
    assert r.is_error and "writing outside the working directory is not allowed" in r.content
    assert not os.path.exists(target)
    r = await run(sandbox, "import os; os.remove('/etc/hostname')")
    assert r.is_error and "os.remove outside the working directory" in r.content


@module_loop
async def test_no_network(sandbox):
    r = await run(sandbox, "import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)")
    assert r.is_error and "network access is disabled" in r.content


@pytest.mark.parametrize("code, message", [
    ("import subprocess; subprocess.run(['true'])", "subprocess.Popen is disabled"),
    ("import os; os.system('true')", "os.system is disabled"),
    ("import os; os.execv('/bin/true', ['true'])", "os.exec is disabled"),
    ("import ctypes; ctypes.CDLL(None).getpid()", "calling C code through ctypes is disabled"),
])
@module_loop
async def test_no_processes_or_ctypes(sandbox, code, message):
    r = await run(sandbox, code)
    assert r.is_error and message in r.content


@module_loop
async def test_runaway_loop_is_killed(sandbox):
    r = await run(sandbox, "while True:\n    pass", timeout_s=1.0)
    assert r.is_error and r.content.endswith("run_python: killed: wall time limit of 1 s exceeded")


@module_loop
async def test_memory_bomb_fails(sandbox):
    r = await run(sandbox, "x = bytearray(1 << 30)\nprint(len(x))")  # 1 GiB > the 256 MiB limit
    assert r.is_error and "MemoryError" in r.content


@module_loop
async def test_output_flood_is_cut(sandbox):
    r = await run(sandbox, "while True:\n    print('x' * 10000)", timeout_s=10.0)
    assert r.is_error and "run_python: killed: output limit exceeded\n--- stdout ---\nxxx" in r.content
    assert "[truncated" in r.content and len(r.content) < 9000


@module_loop
async def test_file_size_limit(sandbox):
    r = await run(sandbox, "open('big.bin', 'wb').write(b'x' * (20 << 20))")  # 20 MiB > the 16 MiB limit
    assert r.is_error and "File too large" in r.content


@module_loop
async def test_numpy_works_inside(sandbox):
    # numpy imports ctypes (allowed: loading is fine, looking up or calling C functions is not)
    r = await run(sandbox, "import numpy as np\nprint(int(np.arange(5).sum()))", timeout_s=20)
    assert r.content == "exit status 0\n--- stdout ---\n10"
