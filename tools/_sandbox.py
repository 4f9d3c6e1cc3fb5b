"""Run untrusted Python sealed by the operating system (what ``python_sandbox`` serves).

    report, ok = await run_sealed("print(6 * 7)", timeout_s=5)

The walls are the kernel's, not Python's (nothing inside the sandbox is trusted, ctypes and
subprocesses included):

- namespaces from util-linux ``unshare`` (no extra package; ``--kill-child``): mount (a new
  root with only the interpreter, its libraries and a tmpfs work dir: no home directories,
  credentials or host configuration), PID (the program sees only its own processes, and all of
  them die when the run ends), network (no interfaces: no network in any form), IPC, UTS and
  cgroup;
- an unprivileged uid of its own that owns nothing on the host, ``no_new_privs``, read-only
  ``nosuid`` mounts: no writes outside ``/work``, a tmpfs of ``disk_mb`` that vanishes with
  the run;
- rlimits: address space (``memory_mb`` per process), CPU (timeout + 1 s), processes and
  threads (``max_processes``; enforced because the uid is not root), file size, open files,
  no core dumps; plus a wall timeout and an output cap enforced from outside;
- memory the address-space limit does not see is refused or bounded: memfd_create and SysV
  shared memory are denied by seccomp, POSIX shared memory lives in a ``/dev/shm`` tmpfs of
  ``shm_mb``, files in ``/work`` count against ``disk_mb``. So a run holds at most
  ``max_processes * memory_mb + disk_mb + shm_mb``. (A memory cgroup would bound the sum
  tighter; the kernels materl is tested on offer cgroup v2 without its memory controller, so
  the bound is built from the pieces above, which hold on any kernel with seccomp);
- sockets: only AF_UNIX (seccomp); the network namespace has no interface anyway;
- no ``/proc``: a proc mount's ``mountinfo`` names the host paths of every bind.

``tools/_sandbox_init.py`` is the PID 1 that builds the root and drops privileges; its
docstring lists each step. Where the kernel refuses (no permission to create namespaces or
mount), the run returns an error saying so instead of running unsealed. As root the program
runs under a fresh uid; without root, ``unshare --user --map-root-user`` is used, and the
process limit then counts the invoking user's processes.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import signal
import sys
import sysconfig
import tempfile
from dataclasses import dataclass

INIT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_init.py")
NAMESPACES = ("--mount", "--pid", "--net", "--ipc", "--uts", "--cgroup", "--fork", "--kill-child")

# The program's runner inside the sandbox: allowed site-packages on sys.path, then main.py as
# __main__, with a traceback that shows only the user's frames (as main.py).
RUNNER = r'''
import os, runpy, sys, traceback
if os.path.isdir("/opt/site-packages"):
    sys.path.extend(os.path.join("/opt/site-packages", d) for d in sorted(os.listdir("/opt/site-packages")))
sys.argv = ["main.py"]
try:
    runpy.run_path("/sandbox/main.py", run_name="__main__")
except SystemExit:
    raise
except BaseException as e:
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == "/sandbox/main.py"]
    for f in frames:
        f.filename = "main.py"
    print("Traceback (most recent call last):", file=sys.stderr)
    print("".join(traceback.format_list(frames)), end="", file=sys.stderr)
    print("".join(traceback.format_exception_only(type(e), e)), end="", file=sys.stderr)
    sys.exit(1)
'''


@dataclass
class Limits:
    memory_mb: int = 512  # address space per process
    max_timeout_s: float = 30.0
    max_processes: int = 8  # processes and threads of the sandbox user
    disk_mb: int = 64  # the /work tmpfs
    shm_mb: int = 16  # the /dev/shm tmpfs (POSIX shared memory; memfd and SysV shm are refused)
    file_size_mb: int = 16
    max_open_files: int = 64
    max_output_chars: int = 8000
    flood_bytes: int = 8 << 20  # kill the run once it has written this much
    max_code_chars: int = 100_000


@dataclass
class Outcome:
    """How a run ended: ``status`` from the sandbox's PID 1, or the reason it was killed."""

    status: dict
    killed: str | None
    stdout: bytes
    stderr: bytes


def python_paths() -> tuple[str, str, list[str]]:
    """(the interpreter's installation prefix, its binary relative to it, site-packages to expose)."""
    prefix = os.path.realpath(sys.base_prefix)
    exe = os.path.relpath(os.path.realpath(sys.executable), prefix)
    if exe.startswith(".."):  # the binary lives outside its prefix: run it by its own path
        exe = os.path.realpath(sys.executable)
    sites = [p for p in dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib")) if os.path.isdir(p)]
    return prefix, exe, sites


def config(code: str, root: str, status_fd: int, timeout_s: float, limits: Limits) -> dict:
    prefix, exe, sites = python_paths()
    in_usr = prefix == "/usr" or prefix.startswith("/usr/")
    python = os.path.join(prefix if in_usr else "/opt/python", exe) if not os.path.isabs(exe) else exe
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/work", "TMPDIR": "/work", "LANG": "C.UTF-8",
           # one BLAS/OpenMP thread: per-thread buffers would eat the address-space limit
           "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    if not in_usr:
        env["LD_LIBRARY_PATH"] = "/opt/python/lib"  # a shared libpython found by its host path otherwise
    return {
        "root": root, "status_fd": status_fd, "code": code, "runner": RUNNER, "python": python,
        "python_prefix": prefix, "site_packages": sites, "env": env, "disk_mb": limits.disk_mb,
        "shm_mb": limits.shm_mb,
        "uid": 100_000 + secrets.randbelow(1 << 24) if os.geteuid() == 0 else None,
        "limits": {"memory_bytes": limits.memory_mb << 20, "cpu_s": int(timeout_s) + 1,
                   "processes": limits.max_processes, "file_bytes": limits.file_size_mb << 20,
                   "open_files": limits.max_open_files},
    }


def command(cfg: dict) -> list[str]:
    unshare = shutil.which("unshare") or "unshare"
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    return [unshare, *user, *NAMESPACES, "--", sys.executable, "-I", "-S", "-B", INIT, json.dumps(cfg)]


async def run_sealed(code: str, timeout_s: float, limits: Limits = Limits()) -> Outcome:
    """Run ``code`` in a fresh sealed sandbox; never raises for anything the code does."""
    tmp = tempfile.mkdtemp(prefix="materl-sandbox-")
    root = os.path.join(tmp, "root")
    os.mkdir(root)
    read_fd, write_fd = os.pipe()
    try:
        argv = command(config(code, root, write_fd, timeout_s, limits))
        env = {"PATH": os.environ.get("PATH", os.defpath), "LANG": "C.UTF-8"}  # nothing else of ours leaks
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=env, pass_fds=(write_fd,), start_new_session=True)
        os.close(write_fd)
        write_fd = -1
        killed, out, err = await _supervise(proc, timeout_s, limits)
        status = _read_status(read_fd)
        if not status and not killed:
            status = {"error": _refusal(err, proc.returncode)}
        return Outcome(status, killed, out, err)
    finally:
        for fd in (read_fd, write_fd):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(tmp, ignore_errors=True)


async def _supervise(proc: asyncio.subprocess.Process, timeout_s: float, limits: Limits):
    """Drain the output; kill the whole sandbox at the wall timeout or on an output flood."""
    cap = limits.max_output_chars * 4 + 16
    out, err = bytearray(), bytearray()
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
    flood = asyncio.ensure_future(flooded.wait())
    done, _ = await asyncio.wait({job, flood}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    flood.cancel()
    killed = None
    if job not in done:
        killed = "output limit exceeded" if flooded.is_set() else f"wall time limit of {timeout_s:g} s exceeded"
        try:  # unshare dies, --kill-child takes PID 1, the kernel takes the rest of the namespace
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            await asyncio.wait_for(job, 10.0)
        except (asyncio.TimeoutError, Exception):
            job.cancel()
    return killed, bytes(out), bytes(err)


def _read_status(fd: int) -> dict:
    os.set_blocking(fd, False)
    try:
        data = os.read(fd, 4096)
    except BlockingIOError:
        return {}
    try:
        return json.loads(data.decode().splitlines()[0]) if data else {}
    except (ValueError, IndexError):
        return {}


def _refusal(stderr: bytes, returncode: int | None) -> str:
    text = stderr.decode("utf-8", "replace").strip().splitlines()
    why = text[-1] if text else f"exit status {returncode}"
    return (f"the sandbox could not be created ({why}); it needs permission to create mount, PID and network "
            f"namespaces: run the server as root, or enable unprivileged user namespaces")
