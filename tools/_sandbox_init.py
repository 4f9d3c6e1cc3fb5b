"""The sandbox's PID 1: builds the sealed filesystem, then runs the user's program as an
unprivileged user. Run by ``tools/_sandbox.py`` as

    unshare --mount --pid --net --ipc --uts --cgroup --fork --kill-child -- \\
        python -I -S -B _sandbox_init.py CONFIG_JSON

so it starts as root in new mount, PID, network, IPC, UTS and cgroup namespaces. It:

1. mounts a small tmpfs as the new root and, read-only with nosuid/nodev, only what the
   interpreter needs: ``/usr`` (with the host's ``/bin``, ``/lib*`` symlinks), the Python
   installation at ``/opt/python``, the allowed site-packages at ``/opt/site-packages/N``,
   ``/etc/ld.so.cache``; device nodes null/zero/full/random/urandom; a ``proc`` that shows only
   this namespace's processes of the caller's own user (``hidepid=invisible,subset=pid``);
   ``/work``, a size-limited tmpfs (the only writable place; ``/tmp`` points to it); the
   program at ``/sandbox``;
2. pivots into it, detaches the host's root, remounts the new root read-only;
3. forks the program with no supplementary groups, a fresh uid/gid that owns nothing on the
   host, ``no_new_privs``, a seccomp filter (no new namespaces, mounts, keyrings, BPF,
   io_uring or kernel modules), rlimits (address space, CPU, processes, file size, open files,
   no core), a clean environment and only fds 0-2;
4. waits for it and exits, which makes the kernel kill every process left in the namespace
   (daemons, setsid or double-forked children included).

The exit status goes to the status fd as one JSON line; a setup failure (the kernel refused a
mount) goes there as ``{"error": ...}``. Nothing here imports beyond the standard library.
"""

import ctypes
import json
import os
import platform
import resource
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_NO_NEW_PRIVS = 38
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
DEVICES = ("null", "zero", "full", "random", "urandom")

libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source, target, fstype=None, flags=0, data=None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {source or fstype} on {target}")


def bind(root: str, source: str, target: str, *, writable: bool = False) -> None:
    """Bind ``source`` (a directory or a file) at ``root + target``, read-only unless ``writable``."""
    path = root + target
    if os.path.isdir(source):
        os.makedirs(path, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "a").close()
    mount(source, path, None, MS_BIND | MS_REC)
    flags = MS_BIND | MS_REMOUNT | MS_NOSUID | (0 if writable else MS_RDONLY | MS_NODEV)
    mount(None, path, None, flags)


def build_root(cfg: dict) -> None:
    root = cfg["root"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=8m,nr_inodes=2048,mode=0755")
    bind(root, "/usr", "/usr")
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        host = "/" + name
        if os.path.islink(host):
            os.symlink(os.readlink(host), f"{root}/{name}")
        elif os.path.isdir(host):
            bind(root, host, host)
    if os.path.exists("/etc/ld.so.cache"):
        bind(root, "/etc/ld.so.cache", "/etc/ld.so.cache")
    if cfg["python_prefix"] != "/usr" and not cfg["python_prefix"].startswith("/usr/"):
        bind(root, cfg["python_prefix"], "/opt/python")
    for i, path in enumerate(cfg["site_packages"]):
        bind(root, path, f"/opt/site-packages/{i}")
    os.makedirs(f"{root}/dev")
    mount("tmpfs", f"{root}/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=0755")
    for dev in DEVICES:
        bind(root, f"/dev/{dev}", f"/dev/{dev}", writable=True)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{root}/dev/{name}")
    os.makedirs(f"{root}/proc")
    mount("proc", f"{root}/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=invisible,subset=pid")
    os.makedirs(f"{root}/work")
    mount("tmpfs", f"{root}/work", "tmpfs", MS_NOSUID | MS_NODEV,
          f"size={cfg['disk_mb']}m,nr_inodes=4096,mode=0700,uid={cfg['uid']},gid={cfg['uid']}")
    os.symlink("/work", f"{root}/tmp")
    os.makedirs(f"{root}/sandbox")
    for name, text in (("main.py", cfg["code"]), ("run.py", cfg["runner"])):
        with open(f"{root}/sandbox/{name}", "w", encoding="utf-8") as f:
            f.write(text)
    pivot(root)


def pivot(root: str) -> None:
    """Make ``root`` the filesystem root and drop every path to the host's."""
    os.makedirs(f"{root}/.old")
    number = SYS_PIVOT_ROOT.get(platform.machine())
    if number is None:
        raise OSError(0, f"pivot_root: unsupported machine {platform.machine()!r}")
    _check(libc.syscall(number, root.encode(), f"{root}/.old".encode()), "pivot_root")
    os.chdir("/")
    _check(libc.umount2(b"/.old", MNT_DETACH), "umount the host root")
    os.rmdir("/.old")
    mount(None, "/", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def become_user(cfg: dict) -> None:
    """In the forked child: limits, then a uid that owns nothing, then no way back."""
    limits = cfg["limits"]
    for rlimit, value in ((resource.RLIMIT_AS, limits["memory_bytes"]), (resource.RLIMIT_CPU, limits["cpu_s"]),
                          (resource.RLIMIT_NPROC, limits["processes"]), (resource.RLIMIT_FSIZE, limits["file_bytes"]),
                          (resource.RLIMIT_NOFILE, limits["open_files"]), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(rlimit, (value, value))
    if cfg["uid"] is not None:
        os.setgroups([])
        os.setresgid(cfg["uid"], cfg["uid"], cfg["uid"])
        os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(no_new_privs)")
    install_seccomp()
    os.chdir("/work")


# -- seccomp: no new namespaces, mounts, keyrings, BPF, io_uring, module loading -----------------
# A second wall behind the uid: an unprivileged process may still create a user namespace (and
# be "root" over nothing); these calls fail with EPERM (clone3 with ENOSYS, so libc falls back
# to clone, whose namespace flags are checked). Syscall numbers per architecture.
BLOCKED = {
    "x86_64": dict(arch=0xC000003E, clone=56, clone3=435, calls=(
        272, 308, 165, 166, 155, 161, 250, 248, 249, 321, 298, 323, 425, 426, 427, 428, 429, 430, 431, 432, 433,
        442, 246, 320, 175, 313, 176, 135)),  # unshare setns mount umount2 pivot_root chroot keyctl add_key
    # request_key bpf perf_event_open userfaultfd io_uring_* open_tree move_mount fs* mount_setattr
    # kexec_load kexec_file_load init_module finit_module delete_module personality
    "aarch64": dict(arch=0xC00000B7, clone=220, clone3=435, calls=(
        97, 268, 40, 39, 41, 51, 219, 217, 218, 280, 241, 282, 425, 426, 427, 428, 429, 430, 431, 432, 433,
        442, 104, 294, 105, 273, 106, 92)),
}
NS_FLAGS = 0x20000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x80


def install_seccomp() -> None:
    table = BLOCKED.get(platform.machine())
    if table is None:  # the namespaces and the uid still hold; this wall is skipped
        return
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ/JGE/JSET|K, BPF_RET
    body = [("ld", 4), ("arch",), ("ld", 0)]
    if platform.machine() == "x86_64":
        body.append(("jge_eperm", 0x40000000))  # the x32 ABI's numbers
    body += [("jeq_eperm", nr) for nr in table["calls"]]
    body += [("jeq_enosys", table["clone3"]), ("clone", table["clone"]), ("ld", 16), ("jset_ns",)]
    n = len(body)  # then: ALLOW at n, EPERM at n+1, ENOSYS at n+2, KILL at n+3
    prog = []
    for i, ins in enumerate(body):
        to = lambda target: target - i - 1  # noqa: E731 - a jump offset from this instruction
        kind = ins[0]
        if kind == "ld":
            prog.append((ld, 0, 0, ins[1]))
        elif kind == "arch":
            prog.append((jeq, 0, to(n + 3), table["arch"]))
        elif kind == "jge_eperm":
            prog.append((jge, to(n + 1), 0, ins[1]))
        elif kind == "jeq_eperm":
            prog.append((jeq, to(n + 1), 0, ins[1]))
        elif kind == "jeq_enosys":
            prog.append((jeq, to(n + 2), 0, ins[1]))
        elif kind == "clone":
            prog.append((jeq, 0, to(n), ins[1]))
        else:  # jset_ns: clone's flags (args[0], low word) ask for a namespace
            prog.append((jset, to(n + 1), to(n), NS_FLAGS))
    prog += [(ret, 0, 0, 0x7FFF0000), (ret, 0, 0, 0x00050000 | 1), (ret, 0, 0, 0x00050000 | 38),
             (ret, 0, 0, 0x80000000)]

    class Filter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]

    filters = (Filter * len(prog))(*[Filter(*ins) for ins in prog])
    program = Program(len(prog), filters)
    _check(libc.prctl(22, 2, ctypes.byref(program), 0, 0), "prctl(seccomp)")  # PR_SET_SECCOMP, MODE_FILTER


def main() -> None:
    cfg = json.loads(sys.argv[1])
    status = cfg["status_fd"]
    try:
        build_root(cfg)
        libc.sethostname(b"sandbox", 7)
    except OSError as exc:
        os.write(status, (json.dumps({"error": f"the kernel refused to build the sandbox: {exc}"}) + "\n").encode())
        os._exit(70)
    pid = os.fork()
    if pid == 0:
        try:
            os.closerange(3, 1 << 16)  # the status fd and anything else inherited
            become_user(cfg)
            os.execve(cfg["python"], [cfg["python"], "-I", "-S", "-B", "/sandbox/run.py"], cfg["env"])
        except BaseException as exc:  # noqa: BLE001 - report it, never fall back to running as root
            os.write(2, f"sandbox: could not start the program: {exc}\n".encode())
        os._exit(71)
    _, wait_status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(wait_status):
        result = {"signal": os.WTERMSIG(wait_status)}
    else:
        result = {"exit": os.WEXITSTATUS(wait_status)}
    os.write(status, (json.dumps(result) + "\n").encode())
    os._exit(0)  # PID 1 exits: the kernel kills whatever the program left behind


if __name__ == "__main__":
    main()
