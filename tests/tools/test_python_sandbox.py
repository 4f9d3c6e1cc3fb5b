"""The sandbox server over stdio: real subprocesses, real namespaces, real limits, attacked.

Every attack asserts an effect on the host that must not happen (a file outside that must not
exist, a host listener that must not be reached, a process that must not survive); limits are
asserted by what the program observes or the error the tool returns, never by timing."""

import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import pytest_asyncio

from materl.rollout.mcp import MCPServer, mcp_tools

ROOT = Path(__file__).resolve().parents[2]
SECRET = "materl-secret-" + uuid.uuid4().hex
module_loop = pytest.mark.asyncio(loop_scope="module")

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox uses Linux namespaces")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sandbox():
    command = [sys.executable, str(ROOT / "tools/python_sandbox.py"), "--memory-mb", "256", "--max-processes", "8"]
    async with mcp_tools(MCPServer(command=command, env={"MATERL_TEST_SECRET": SECRET}), timeout_s=60) as tb:
        yield tb


async def run(tb, code, timeout_s=10.0):
    return await tb.call("run_python", {"code": code, "timeout_s": timeout_s})


def stdout(result) -> str:
    return result.content.split("--- stdout ---\n", 1)[1].split("\n--- stderr ---", 1)[0] if "--- stdout ---" in \
        result.content else ""


def host_processes_with(marker: str) -> list[int]:
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            text = Path(f"/proc/{pid}/cmdline").read_bytes() + Path(f"/proc/{pid}/comm").read_bytes()
        except OSError:
            continue
        if marker.encode() in text:
            pids.append(int(pid))
    return pids


def wait_gone(marker: str) -> list[int]:
    deadline = time.monotonic() + 10  # the kernel reaps a dead namespace asynchronously
    while (left := host_processes_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


# -- it works -----------------------------------------------------------------------------------

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
async def test_work_dir_is_private_fresh_and_writable(sandbox):
    r = await run(sandbox, "import os\nprint(os.getcwd(), os.listdir('.'))\nopen('notes.txt', 'w').write('x')\n"
                           "print(open('/tmp/notes.txt').read())\nimport subprocess\n"
                           "print(subprocess.run(['sh', '-c', 'echo hi from sh'], capture_output=True, text=True).stdout)")
    assert stdout(r) == "/work []\nx\nhi from sh"
    again = await run(sandbox, "import os; print(os.listdir('.'))")
    assert stdout(again) == "[]"  # the previous run's file is gone


@module_loop
async def test_numpy_works_inside(sandbox):
    r = await run(sandbox, "import numpy as np\nprint(int(np.arange(5).sum()))", timeout_s=20)
    assert r.content == "exit status 0\n--- stdout ---\n10"


# -- no writes outside /work --------------------------------------------------------------------

WRITE_ATTACKS = r'''
import ctypes, os, shutil, sys
target = sys.argv_target
def attempt(name, fn):
    try:
        fn()
        print(name, "returned")
    except BaseException as e:
        print(name, type(e).__name__)
def via_dir_fd():
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    os.open(target.lstrip("/"), os.O_CREAT | os.O_WRONLY, dir_fd=fd)
def via_mkdir_dir_fd():
    fd = os.open(os.path.dirname(os.path.dirname(target)) or "/", os.O_RDONLY)
    os.mkdir(os.path.basename(os.path.dirname(target)) + "/pwned-dir", dir_fd=fd)
def via_rename():
    open("/work/payload", "w").write("x")
    os.rename("/work/payload", target)
def via_symlink():
    os.symlink(target, "/work/link")
    open("/work/link", "w").write("x")
def via_hardlink():
    os.link("/usr/bin/env", "/work/env-link")
def via_proc_root():
    open("/proc/self/root" + target, "w").write("x")
def via_proc_1_root():
    open("/proc/1/root" + target, "w").write("x")
def via_proc_cwd():
    open("/proc/self/cwd/../../.." + target, "w").write("x")
def via_usr():
    open("/usr/pwned", "w").write("x")
def via_proc_root_usr():
    open("/proc/self/root/usr/pwned", "w").write("x")
def via_dir_fd_usr():
    fd = os.open("/usr", os.O_RDONLY | os.O_DIRECTORY)
    os.open("pwned", os.O_CREAT | os.O_WRONLY, dir_fd=fd)
def via_rename_into_usr():
    open("/work/payload2", "w").write("x")
    os.rename("/work/payload2", "/usr/pwned")
def via_ctypes_mount():
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(b"none", b"/usr", b"tmpfs", 0, None) != 0:
        raise OSError(ctypes.get_errno(), "mount")
def via_ctypes_userns():  # a user namespace would make it root over a mount namespace of its own
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x10000000 | 0x00020000) != 0:  # CLONE_NEWUSER | CLONE_NEWNS
        raise OSError(ctypes.get_errno(), "unshare")
    libc.mount(b"/work", b"/usr", None, 4096, None)
    open("/usr/pwned", "w").write("x")
def via_chroot():
    os.chroot("/work")
def via_setuid_root():
    os.setuid(0)
for name, fn in list(globals().items()):
    if name.startswith("via_"):
        attempt(name, fn)
'''


@module_loop
async def test_no_writes_outside_work_by_any_path(sandbox, tmp_path):
    target = str(tmp_path / "pwned")
    code = WRITE_ATTACKS.replace("sys.argv_target", repr(target))
    r = await run(sandbox, code, timeout_s=20)
    lines = dict(line.split(" ", 1) for line in stdout(r).splitlines())
    assert not os.path.exists(target) and not os.path.exists(tmp_path / "pwned-dir")
    assert list(tmp_path.iterdir()) == []
    assert not os.path.exists("/usr/pwned")
    # the host path does not exist inside (its /tmp is /work), so those attempts write into
    # /work at most; anything aimed at the sandbox's own read-only tree must fail
    for attack in ("via_usr", "via_proc_root_usr", "via_dir_fd_usr", "via_rename_into_usr", "via_proc_1_root",
                   "via_ctypes_mount", "via_ctypes_userns", "via_chroot", "via_setuid_root", "via_hardlink"):
        assert lines[attack] != "returned", attack
    assert lines["via_ctypes_userns"] == "PermissionError"  # seccomp: no user namespace to be root in


@module_loop
async def test_subprocesses_and_reloaded_c_extensions_stay_inside(sandbox, tmp_path):
    """The old sandbox was escaped by re-importing _posixsubprocess; now starting processes is
    allowed, and they are inside the same walls."""
    target = tmp_path / "pwned"
    code = f"""
import importlib, subprocess, sys
sys.modules.pop("_posixsubprocess", None)
fresh = importlib.import_module("_posixsubprocess")
print(subprocess.run(["sh", "-c", "mkdir -p {tmp_path} && touch {target} && ls {target}"],
                     capture_output=True, text=True).stdout.strip())
"""
    r = await run(sandbox, code)
    assert stdout(r) == str(target)  # it wrote the file, into its own /tmp (= /work)
    assert not target.exists() and list(tmp_path.iterdir()) == []


# -- no view of the host ------------------------------------------------------------------------

@module_loop
async def test_sees_only_what_the_interpreter_needs(sandbox):
    code = '''
import os
print(sorted(os.listdir("/")))
for p in ("/root", "/home", "/etc/passwd", "/etc/shadow", "/etc/hostname", "/work/wt-tools", "/proc", "/proc/1",
          "/sys", "/var", "/run"):
    print(p, os.path.exists(p))
print(sorted(os.listdir("/dev")))
print(os.listdir("/etc"), os.getuid() != 0, os.uname().nodename)
'''
    r = await run(sandbox, code)
    lines = stdout(r).splitlines()
    assert lines[0] == str(sorted(["bin", "dev", "etc", "lib", "lib64", "opt", "sandbox", "sbin", "tmp", "usr", "work"]))
    assert all(line.endswith(" False") for line in lines[1:12]), lines[1:12]  # no /proc (mountinfo: host paths)
    assert lines[12] == str(["full", "null", "random", "shm", "urandom", "zero"])
    assert lines[13] == "['ld.so.cache'] True sandbox"


@module_loop
async def test_no_environment_or_descriptor_leaks(sandbox):
    code = '''
import os
print(sorted(os.environ))
print(os.path.exists("/proc"))
open_fds = []
for fd in range(3, 256):
    try:
        os.fstat(fd)
        open_fds.append(fd)
    except OSError:
        pass
print(open_fds)
'''
    r = await run(sandbox, code)
    lines = stdout(r).splitlines()
    assert SECRET not in r.content
    # LD_LIBRARY_PATH only where the interpreter lives outside /usr (pyenv, conda, a venv's base):
    # the sandbox mounts it at /opt/python, where its shared libpython must be found
    base = os.path.realpath(sys.base_prefix)
    mounted = ["LD_LIBRARY_PATH"] if base != "/usr" and not base.startswith("/usr/") else []
    assert lines[0] == str(sorted(["HOME", "LANG", "MKL_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                   "PATH", "TMPDIR", *mounted]))
    assert lines[1] == "False"  # no /proc/*/environ to read other processes' environments from
    assert lines[2] == "[]"  # only fds 0-2


# -- no network ---------------------------------------------------------------------------------

@module_loop
async def test_no_network_in_any_form(sandbox, tmp_path):
    tcp = socket.create_server(("127.0.0.1", 0))
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    abstract_name = "\0materl-sandbox-" + uuid.uuid4().hex
    abstract.bind(abstract_name)
    abstract.listen()
    path_sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path_sock.bind(str(tmp_path / "s.sock"))
    path_sock.listen()
    for s in (tcp, udp, abstract, path_sock):
        s.setblocking(False)
    code = f'''
import socket
def attempt(name, fn):
    try:
        fn()
        print(name, "returned")
    except BaseException as e:
        print(name, type(e).__name__)
attempt("tcp", lambda: socket.create_connection(("127.0.0.1", {tcp.getsockname()[1]}), timeout=2))
attempt("udp", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", ("127.0.0.1", {udp.getsockname()[1]})))
attempt("tcp6", lambda: socket.create_connection(("::1", {tcp.getsockname()[1]}), timeout=2))
attempt("abstract", lambda: socket.socket(socket.AF_UNIX).connect({abstract_name!r}))
attempt("unix_path", lambda: socket.socket(socket.AF_UNIX).connect({str(tmp_path / "s.sock")!r}))
attempt("dns", lambda: socket.getaddrinfo("example.com", 80))
attempt("raw", lambda: socket.socket(socket.AF_PACKET, socket.SOCK_RAW))
attempt("public", lambda: socket.create_connection(("1.1.1.1", 53), timeout=2))
attempt("interfaces", socket.if_nameindex)  # netlink: refused by the socket-family filter
'''
    try:
        r = await run(sandbox, code)
        for s in (tcp, abstract, path_sock):
            with pytest.raises(BlockingIOError):
                s.accept()  # nobody connected
        with pytest.raises(BlockingIOError):
            udp.recvfrom(10)  # nothing arrived
    finally:
        for s in (tcp, udp, abstract, path_sock):
            s.close()
    lines = dict(line.split(" ", 1) for line in stdout(r).splitlines())
    assert all(lines[k] != "returned" for k in ("tcp", "tcp6", "abstract", "unix_path", "dns", "raw", "public",
                                                "interfaces")), lines
    assert lines["tcp"] == lines["raw"] == lines["interfaces"] == "PermissionError"  # seccomp: AF_UNIX only


# -- processes: limited, and none outlives the call ---------------------------------------------

@module_loop
async def test_daemons_and_double_forks_die_with_the_call(sandbox):
    marker = "mtrl" + uuid.uuid4().hex[:8]
    code = f'''
import os, subprocess, sys, time
subprocess.Popen(["setsid", "sh", "-c", "sleep 600 & exec sleep 601"], start_new_session=True)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(602)  # {marker}"])
    os._exit(0)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(603)  # {marker}"], start_new_session=True)
time.sleep(0.5)
print("left", child.poll() is None)
'''
    r = await run(sandbox, code)
    assert "left True" in r.content  # they were running when the program ended
    assert wait_gone(marker) == []


@module_loop
async def test_fork_bomb_is_capped_and_cleaned_up(sandbox):
    marker = "bmb" + uuid.uuid4().hex[:8]
    code = f'''
import ctypes, os, time
libc = ctypes.CDLL(None)
n = 0
for _ in range(1000):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        libc.prctl(15, b"{marker}", 0, 0, 0)
        time.sleep(600)
        os._exit(0)
    n += 1
print("forked", n)
'''
    r = await run(sandbox, code)
    forked = int(stdout(r).split()[-1])
    assert 1 <= forked <= 7  # 8 processes of the sandbox user, the program included
    assert wait_gone(marker) == []


@module_loop
async def test_thread_bomb_is_capped(sandbox):
    code = '''
import threading, time
n = 0
try:
    for _ in range(1000):
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
        n += 1
except RuntimeError as e:
    print("stopped:", e)
print("threads", n)
'''
    r = await run(sandbox, code)
    assert "stopped: can't start new thread" in r.content
    assert int(stdout(r).split()[-1]) <= 7


@module_loop
async def test_memory_and_disk_limits(sandbox):
    r = await run(sandbox, "x = bytearray(1 << 30)")  # 1 GiB > the 256 MiB limit
    assert r.is_error and "MemoryError" in r.content
    r = await run(sandbox, "import mmap; mmap.mmap(-1, 4 << 30)")
    assert r.is_error and ("MemoryError" in r.content or "Cannot allocate memory" in r.content)
    r = await run(sandbox, "open('big.bin', 'wb').write(b'x' * (20 << 20))")  # 20 MiB > the 16 MiB per file
    assert r.is_error and "File too large" in r.content
    code = "for i in range(10):\n    open(f'part{i}', 'wb').write(b'x' * (15 << 20))"  # 150 MiB > the 64 MiB disk
    r = await run(sandbox, code)
    assert r.is_error and "No space left on device" in r.content


@module_loop
async def test_runaway_loop_is_killed(sandbox):
    r = await run(sandbox, "while True:\n    pass", timeout_s=1.0)
    assert r.is_error and r.content.endswith("run_python: killed: wall time limit of 1 s exceeded")


@module_loop
async def test_output_flood_is_cut(sandbox):
    r = await run(sandbox, "while True:\n    print('x' * 10000)", timeout_s=10.0)
    assert r.is_error and "run_python: killed: output limit exceeded\n--- stdout ---\nxxx" in r.content
    assert "[truncated" in r.content and len(r.content) < 9000


def test_a_kernel_that_refuses_namespaces_gives_a_clear_error():
    """Inside a user namespace whose mount-namespace quota is 0, unshare fails: the run must
    answer with an error saying so, not run the code unsealed."""
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("user namespaces are not available here")
    script = ("import asyncio, sys; sys.path.insert(0, 'tools'); from python_sandbox import run_code; "
              "print(asyncio.run(run_code('print(\"ran\")', 5)))")
    out = subprocess.run(["unshare", "--user", "--map-root-user", "sh", "-c",
                          f"echo 0 > /proc/sys/user/max_mnt_namespaces && exec {sys.executable} -c \"{script}\""],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert "sandbox error: the sandbox could not be created" in out.stdout, out.stderr
    assert "No space left on device" in out.stdout and "'ran'" not in out.stdout and "\nran" not in out.stdout
