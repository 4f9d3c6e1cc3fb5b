"""The python sandbox attacked where issue #26 found it open (item 6): memory that the
address-space limit does not see (memfd, SysV shared memory, /dev/shm), socket families other
than AF_UNIX, and host paths in /proc/self/mountinfo. Each attack runs in a real sealed
sandbox (namespaces, seccomp, rlimits) with a 256 MB limit and must fail inside it."""

import json
import os
import sys
import sysconfig

import pytest

from materl.tools._sandbox import Limits, run_sealed

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox is built from Linux namespaces")
LIMITS = Limits(memory_mb=256, shm_mb=16, file_size_mb=64)  # files may be bigger than /dev/shm
MB = 1 << 20


async def sealed(code: str) -> dict:
    """Run ``code``; its last stdout line is a JSON report."""
    outcome = await run_sealed(code, 20, LIMITS)
    assert outcome.killed is None and outcome.status == {"exit": 0}, (outcome.status, outcome.stderr.decode())
    return json.loads(outcome.stdout.decode().strip().splitlines()[-1])


async def test_memfd_cannot_pin_memory_past_the_limit():
    # 300 MB written into a memfd with write() is never mapped, so RLIMIT_AS would not see it
    # (issue: 960 MB pinned under a 512 MB limit). Both the libc wrapper and the raw syscall
    # (x86_64 319, aarch64 279) are refused with EPERM, before a byte is held.
    report = await sealed(r'''
import ctypes, json, os, platform
out = {}
try:
    fd = os.memfd_create("pin")
    for _ in range(300):
        os.write(fd, b"x" * (1 << 20))
    out["memfd"] = "wrote 300 MB"
except OSError as e:
    out["memfd"] = e.errno
libc = ctypes.CDLL(None, use_errno=True)
nr = {"x86_64": 319, "aarch64": 279}[platform.machine()]
out["raw"] = [libc.syscall(nr, b"pin", 0), ctypes.get_errno()]
print(json.dumps(out))
''')
    assert report == {"memfd": 1, "raw": [-1, 1]}  # EPERM = 1


async def test_sysv_shared_memory_is_refused():
    # shmget(IPC_PRIVATE, 300 MB, IPC_CREAT | 0600), then attach and touch it: a detached segment
    # outlives its mapping and is not counted by RLIMIT_AS. msgget (queues) goes the same way.
    report = await sealed(r'''
import ctypes, json
libc = ctypes.CDLL(None, use_errno=True)
libc.shmget.restype = ctypes.c_int
out = {"shmget": [libc.shmget(0, 300 << 20, 0o1000 | 0o600), ctypes.get_errno()]}
out["msgget"] = [libc.msgget(0, 0o1000 | 0o600), ctypes.get_errno()]
print(json.dumps(out))
''')
    assert report == {"shmget": [-1, 1], "msgget": [-1, 1]}


async def test_dev_shm_is_a_small_tmpfs():
    # Writing 300 MB into /dev/shm stops at its 16 MB size with ENOSPC (28); POSIX shared
    # memory (multiprocessing.shared_memory, sem_open) lives there, in the same 16 MB.
    report = await sealed(r'''
import json, os
written, err = 0, None
try:
    with open("/dev/shm/pin", "wb") as f:
        for _ in range(300):
            f.write(b"x" * (1 << 20))
            f.flush()
            written += 1 << 20
except OSError as e:
    err = e.errno
st = os.statvfs("/dev/shm")
print(json.dumps({"written": written, "errno": err, "size": st.f_blocks * st.f_frsize}))
''')
    assert report["errno"] == 28 and report["size"] == 16 * MB
    assert 0 < report["written"] <= 16 * MB


async def test_only_unix_sockets():
    # AF_VSOCK succeeded before (issue); AF_NETLINK and AF_INET worked inside the network
    # namespace. Now every family but AF_UNIX is refused by seccomp (EPERM), also through the
    # raw syscall; socketpair(AF_UNIX) still works (Python's own machinery uses it).
    report = await sealed(r'''
import ctypes, json, platform, socket
out = {}
for name, fam, kind in (("vsock", 40, socket.SOCK_STREAM), ("netlink", socket.AF_NETLINK, socket.SOCK_RAW),
                        ("packet", socket.AF_PACKET, socket.SOCK_RAW), ("inet", socket.AF_INET, socket.SOCK_STREAM),
                        ("inet6", socket.AF_INET6, socket.SOCK_DGRAM), ("unix", socket.AF_UNIX, socket.SOCK_STREAM)):
    try:
        socket.socket(fam, kind).close()
        out[name] = "ok"
    except OSError as e:
        out[name] = e.errno
libc = ctypes.CDLL(None, use_errno=True)
nr = {"x86_64": 41, "aarch64": 198}[platform.machine()]
out["raw_vsock"] = [libc.syscall(nr, 40, 1, 0), ctypes.get_errno()]
a, b = socket.socketpair()
a.sendall(b"hi")
out["pair"] = b.recv(2).decode()
print(json.dumps(out))
''')
    assert report == {"vsock": 1, "netlink": 1, "packet": 1, "inet": 1, "inet6": 1, "unix": "ok",
                      "raw_vsock": [-1, 1], "pair": "hi"}


async def test_no_host_path_is_visible():
    # mountinfo named the virtualenv's and the interpreter's host paths (the binds' roots); the
    # sandbox has no /proc at all now. Every place a mount table could be read from is absent,
    # and nothing the program can read names the host paths.
    host_paths = {os.path.realpath(sys.base_prefix), *(os.path.realpath(p) for p in
                  {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})}
    report = await sealed(r'''
import json, os
out = {}
for path in ("/proc/self/mountinfo", "/proc/self/mounts", "/proc/1/mountinfo", "/proc/thread-self/mountinfo",
             "/etc/mtab", "/sys/fs"):
    try:
        out[path] = open(path).read()
    except OSError as e:
        out[path] = e.errno
seen = []
for top, dirs, files in os.walk("/", followlinks=False):
    if top.startswith(("/usr", "/opt")):
        dirs[:] = []
    seen.append(top)
    seen.extend(os.readlink(os.path.join(top, f)) for f in files if os.path.islink(os.path.join(top, f)))
out["seen"] = seen
out["cwd"] = os.getcwd()
print(json.dumps(out))
''')
    assert all(report[p] in (2, 13) for p in ("/proc/self/mountinfo", "/proc/self/mounts", "/proc/1/mountinfo",
                                                 "/proc/thread-self/mountinfo", "/etc/mtab", "/sys/fs")), report
    text = json.dumps(report)
    leaked = [p for p in host_paths if p not in ("/usr", "/") and p in text]
    assert leaked == [], leaked
    assert "materl-sandbox-" not in text and report["cwd"] == "/work"
