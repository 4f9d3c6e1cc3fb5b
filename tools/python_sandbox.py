"""Python sandbox MCP server: one tool, ``run_python(code, timeout_s=5)``.

    python -m materl.tools.python_sandbox [--memory-mb 512] [--max-timeout 30] [--http PORT]

Each call runs ``code`` in a fresh ``python -I -B`` subprocess, in a fresh temporary working
directory that is deleted afterwards, and returns its exit status, stdout and stderr (each
truncated to 8,000 characters). A program that does not exit 0 comes back as a tool error.

Walls, in the order the child's bootstrap raises them, before any user code runs:

1. rlimits: ``RLIMIT_CPU`` (timeout + 1 s), ``RLIMIT_AS`` (memory), ``RLIMIT_FSIZE`` (16 MiB per
   file), ``RLIMIT_NOFILE`` (64). The parent also kills the process group at the wall timeout
   and when the output passes 8 MiB.
2. no network: ``unshare(CLONE_NEWUSER | CLONE_NEWNET)`` through ctypes puts the child in an
   empty network namespace (not even loopback is up). Where the kernel refuses user namespaces
   this step is skipped and wall 3 still refuses sockets.
3. a ``sys.addaudithook`` hook that refuses ``socket.*`` events, opening a file for writing (and
   remove/rename/mkdir/...) outside the working directory, ``subprocess``/``os.system``/
   ``os.exec*``/``os.fork``/``os.posix_spawn``/``os.kill`` events, ``ctypes.*`` events but
   ``ctypes.dlopen`` (numpy and sympy import ctypes; no C function can be looked up or
   called), raising rlimits, and re-importing ``_posixsubprocess`` (whose ``fork_exec``, which
   raises no audit event, the bootstrap replaces with a refusal).

Deliberate difference from a ``preexec_fn``: walls 1 and 2 run inside the child's bootstrap
(``python -c``), not in ``preexec_fn``, because ``preexec_fn`` is unsafe in a process with
threads and the MCP server runs worker threads. Audit hooks are not a security boundary on
their own; for hostile code run the server itself inside a container.
verl counterpart: ``verl.tools.sandbox_fusion_tools`` (a remote sandbox service over HTTP).
"""

from __future__ import annotations

import asyncio
import math
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

try:
    from materl.tools._serve import parser as _parser, serve as _serve
except ImportError:  # pragma: no cover - run as a plain script from a checkout
    from _serve import parser as _parser, serve as _serve  # type: ignore[no-redef]


@dataclass
class Limits:
    memory_mb: int = 512
    max_timeout_s: float = 30.0
    file_size_mb: int = 16
    max_open_files: int = 64
    max_output_chars: int = 8000
    flood_bytes: int = 8 << 20  # kill the child once it has written this much
    max_code_chars: int = 100_000
    max_parallel: int = 4


LIMITS = Limits()

# Runs in the child as ``python -I -B -c BOOTSTRAP WORKDIR CODEFILE CPU_S MEM_B FSIZE_B NOFILE``.
BOOTSTRAP = r'''
import os, sys, resource, traceback
def _walls(work, cpu, mem, fsize, nofile):
    R = resource
    for lim, soft, hard in ((R.RLIMIT_CPU, cpu, cpu + 1), (R.RLIMIT_AS, mem, mem),
                            (R.RLIMIT_FSIZE, fsize, fsize), (R.RLIMIT_NOFILE, nofile, nofile)):
        R.setrlimit(lim, (soft, hard))
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).unshare(0x10000000 | 0x40000000)  # NEWUSER | NEWNET
    except Exception:
        pass
    realpath, fsdecode, sep = os.path.realpath, os.fsdecode, os.sep
    W = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    blocked = {"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
               "os.fork", "os.forkpty", "os.kill", "os.killpg", "pty.spawn", "os.startfile",
               "resource.setrlimit", "resource.prlimit", "sys.remote_exec"}
    no_import = {"_posixsubprocess"}  # its fork_exec raises no audit event: neutered below
    path_events = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown",
                   "os.link", "os.symlink", "os.truncate", "os.utime", "os.mkfifo", "os.mknod",
                   "shutil.rmtree", "shutil.move", "shutil.copyfile", "os.chflags", "os.lchflags"}
    def inside(path):
        if isinstance(path, int):
            return True  # a descriptor the process already holds
        try:
            full = realpath(fsdecode(path))
        except Exception:
            return False
        return full == work or full.startswith(work + sep)
    def refuse(what):
        raise PermissionError("sandbox: " + what)
    def hook(event, args):
        if event == "open":
            flags = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
            mode = args[1] if len(args) > 1 and isinstance(args[1], str) else ""
            if (flags & W or any(c in mode for c in "wax+")) and not inside(args[0]):
                refuse("writing outside the working directory is not allowed: %r" % (args[0],))
        elif event.startswith("socket."):
            refuse("network access is disabled")
        elif event.startswith("ctypes.") and event != "ctypes.dlopen":  # numpy/sympy import ctypes
            refuse("calling C code through ctypes is disabled")
        elif event in blocked:
            refuse(event + " is disabled (no subprocesses, signals or rlimit changes)")
        elif event == "import" and args[0] in no_import:
            refuse("importing %s is disabled" % args[0])
        elif event in path_events:
            for a in args[:2]:
                if isinstance(a, (str, bytes, os.PathLike)) and not inside(a):
                    refuse("%s outside the working directory is not allowed: %r" % (event, a))
    import _posixsubprocess
    def no_fork_exec(*args, **kwargs):
        refuse("starting subprocesses is disabled")
    _posixsubprocess.fork_exec = no_fork_exec  # subprocess imports fine, Popen is refused
    sys.addaudithook(hook)
_work, _code_file = sys.argv[1], sys.argv[2]
_limits = [int(x) for x in sys.argv[3:7]]
import runpy
_walls(os.path.realpath(_work), *_limits)
sys.argv = ["main.py"]
del _walls, _work, _limits
try:
    runpy.run_path(_code_file, run_name="__main__")  # inside the limits and the audit hook set above
except SystemExit:
    raise
except BaseException as _e:
    _frames = [f for f in traceback.extract_tb(_e.__traceback__) if f.filename == _code_file]
    for _f in _frames:  # show the user's file as main.py, without the runner's frames
        _f.filename = "main.py"
    print("Traceback (most recent call last):", file=sys.stderr)
    print("".join(traceback.format_list(_frames)), end="", file=sys.stderr)
    print("".join(traceback.format_exception_only(type(_e), _e)), end="", file=sys.stderr)
    sys.exit(1)
'''


async def run_code(code: str, timeout_s: float, limits: Limits = LIMITS) -> tuple[str, bool]:
    """Run ``code`` under the sandbox; returns (report text, ok) where ok means exit status 0."""
    if len(code) > limits.max_code_chars:
        return f"code has {len(code)} characters; the limit is {limits.max_code_chars}", False
    timeout_s = float(timeout_s) if math.isfinite(float(timeout_s)) else 5.0
    timeout_s = min(max(timeout_s, 0.1), limits.max_timeout_s)
    root = tempfile.mkdtemp(prefix="materl-sandbox-")
    try:
        work = os.path.join(root, "work")
        os.mkdir(work)
        code_file = os.path.join(root, "main.py")
        with open(code_file, "w", encoding="utf-8") as f:
            f.write(code)
        argv = [sys.executable, "-I", "-B", "-c", BOOTSTRAP, work, code_file, str(int(timeout_s) + 1),
                str(limits.memory_mb << 20), str(limits.file_size_mb << 20), str(limits.max_open_files)]
        env = {"PATH": os.defpath, "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8",
               # one BLAS/OpenMP thread: per-thread buffers would eat the address-space limit
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        return await _run(argv, work, env, timeout_s, limits)
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def _run(argv: list[str], cwd: str, env: dict, timeout_s: float, limits: Limits) -> tuple[str, bool]:
    proc = await asyncio.create_subprocess_exec(
        *argv, cwd=cwd, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, start_new_session=True)
    out, err = bytearray(), bytearray()
    cap = limits.max_output_chars * 4 + 16
    written = [0]
    flooded = asyncio.Event()

    async def drain(stream: asyncio.StreamReader, buf: bytearray) -> None:
        while chunk := await stream.read(1 << 16):
            buf += chunk[: max(0, cap - len(buf))]
            written[0] += len(chunk)
            if written[0] > limits.flood_bytes:
                flooded.set()

    async def finish() -> None:
        await asyncio.gather(drain(proc.stdout, out), drain(proc.stderr, err))
        await proc.wait()

    job = asyncio.ensure_future(finish())
    flood_wait = asyncio.ensure_future(flooded.wait())
    done, _ = await asyncio.wait({job, flood_wait}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    flood_wait.cancel()
    reason = None
    if job not in done:
        reason = "output limit exceeded" if flooded.is_set() else f"wall time limit of {timeout_s:g} s exceeded"
        _kill_group(proc.pid)
        try:
            await asyncio.wait_for(job, 5.0)
        except (asyncio.TimeoutError, Exception):
            job.cancel()
    return _report(proc.returncode, reason, out, err, timeout_s, limits)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _report(rc: int | None, reason: str | None, out: bytes, err: bytes, timeout_s: float,
            limits: Limits) -> tuple[str, bool]:
    if reason is not None:
        status = f"killed: {reason}"
    elif rc is not None and rc < 0:
        sig = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else str(-rc)
        why = f" (CPU time limit of {int(timeout_s) + 1} s)" if sig == "SIGXCPU" else ""
        status = f"killed by {sig}{why}"
    else:
        status = f"exit status {rc}"
    parts = [status]
    for label, data in (("stdout", out), ("stderr", err)):
        text = _truncate(bytes(data).decode("utf-8", "replace"), limits.max_output_chars).rstrip()
        if text:
            parts.append(f"--- {label} ---\n{text}")
    return "\n".join(parts), reason is None and rc == 0


def _truncate(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n... [truncated {len(text) - limit} more characters]"


app = MCPServer("python_sandbox", instructions="Run Python code in a sandbox.", log_level="WARNING")
_slots: asyncio.Semaphore | None = None


@app.tool()
async def run_python(code: str, timeout_s: float = 5.0) -> str:
    """Run Python 3 code in a fresh sandboxed interpreter and return its output.

    Print what you want to see. No network, no subprocesses, files only in the working
    directory (deleted afterwards), limited memory and time. Returns the exit status,
    stdout and stderr.
    """
    global _slots
    if _slots is None:
        _slots = asyncio.Semaphore(LIMITS.max_parallel)
    async with _slots:
        text, ok = await run_code(code, timeout_s)
    if not ok:
        raise ToolError(text)
    return text


def main(argv: list[str] | None = None) -> None:
    p = _parser("materl python sandbox MCP server")
    p.add_argument("--memory-mb", type=int, default=LIMITS.memory_mb, help="address-space limit per run")
    p.add_argument("--max-timeout", type=float, default=LIMITS.max_timeout_s, help="cap on timeout_s")
    p.add_argument("--max-parallel", type=int, default=LIMITS.max_parallel, help="concurrent runs")
    args = p.parse_args(argv)
    LIMITS.memory_mb, LIMITS.max_timeout_s, LIMITS.max_parallel = (
        args.memory_mb, args.max_timeout, args.max_parallel)
    _serve(app, args)


if __name__ == "__main__":
    main()
