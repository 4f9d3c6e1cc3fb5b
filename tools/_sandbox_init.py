"""The sandbox's PID 1: builds the sealed filesystem, then runs the user's program as an
unprivileged user. Run by ``tools/_sandbox.py`` as

    unshare --mount --pid --net --ipc --uts --cgroup --fork --kill-child -- \\
        python -I -S -B _sandbox_init.py CONFIG_JSON

so it starts as root in new mount, PID, network, IPC, UTS and cgroup namespaces. It:

1. mounts a small tmpfs as the new root and, read-only with nosuid/nodev, only what the
   interpreter needs: ``/usr`` (with the host's ``/bin``, ``/lib*`` symlinks), the Python
   installation at ``/opt/python``, the allowed site-packages at ``/opt/site-packages/N``,
   ``/etc/ld.so.cache``; device nodes null/zero/full/random/urandom; ``/dev/shm``, a tmpfs of
   ``shm_mb``; no ``proc`` at all (its ``mountinfo`` would show the host paths the binds come
   from, e.g. the virtualenv's; so ``/dev/fd`` and ``/dev/stdout`` do not exist either);
   ``/work``, a size-limited tmpfs (the only writable place; ``/tmp`` points to it); the
   program at ``/sandbox``;
2. pivots into it, detaches the host's root, remounts the new root read-only;
3. forks the program with no supplementary groups, a fresh uid/gid that owns nothing on the
   host, ``no_new_privs``, a seccomp filter (no new namespaces, mounts, keyrings, BPF,
   io_uring, kernel modules, memfd, SysV shared memory or message queues, POSIX message queues,
   sockets other than AF_UNIX), rlimits (address space, CPU, processes, file size, open files,
   no core, no message-queue bytes), a clean environment and only fds 0-2;
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
    os.makedirs(f"{root}/dev/shm")  # POSIX shared memory and semaphores: counted in its own small tmpfs
    mount("tmpfs", f"{root}/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
          f"size={cfg['shm_mb']}m,nr_inodes=1024,mode=1777")
    # No procfs: /proc/self/mountinfo would show the host paths the binds come from.
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
                          (resource.RLIMIT_NOFILE, limits["open_files"]), (resource.RLIMIT_CORE, 0),
                          (resource.RLIMIT_MSGQUEUE, 0)):
        resource.setrlimit(rlimit, (value, value))
    if cfg["uid"] is not None:
        os.setgroups([])
        os.setresgid(cfg["uid"], cfg["uid"], cfg["uid"])
        os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(no_new_privs)")
    install_seccomp()
    os.chdir("/work")


# -- seccomp: no new namespaces, mounts, keyrings, BPF, io_uring, module loading, memory outside
# the limits, or sockets other than AF_UNIX -----------------------------------------------------
# A second wall behind the uid: an unprivileged process may still create a user namespace (and
# be "root" over nothing); these calls fail with EPERM (clone3 with ENOSYS, so libc falls back
# to clone, whose namespace flags are checked). memfd_create, memfd_secret and SysV shared
# memory / message queues and POSIX message queues are refused: their pages are not counted by
# RLIMIT_AS (a memfd written with write() and never mapped, a shm segment detached again), so
# they would pin memory past ``memory_mb``; shared memory goes through the size-limited
# /dev/shm instead. socket()/socketpair() with a family other than AF_UNIX fail with EPERM
# (AF_INET has no interface in the network namespace; AF_NETLINK, AF_PACKET, AF_VSOCK, ... are
# refused outright). Syscall numbers per architecture.
BLOCKED = {
    "x86_64": dict(arch=0xC000003E, clone=56, clone3=435, socket=41, socketpair=53, calls=(
        272, 308, 165, 166, 155, 161, 250, 248, 249, 321, 298, 323, 425, 426, 427, 428, 429, 430, 431, 432, 433,
        442, 246, 320, 175, 313, 176, 135, 319, 447, 29, 68, 240)),  # unshare setns mount umount2 pivot_root
    # chroot keyctl add_key request_key bpf perf_event_open userfaultfd io_uring_* open_tree move_mount fs*
    # mount_setattr kexec_load kexec_file_load init_module finit_module delete_module personality
    # memfd_create memfd_secret shmget msgget mq_open
    "aarch64": dict(arch=0xC00000B7, clone=220, clone3=435, socket=198, socketpair=199, calls=(
        97, 268, 40, 39, 41, 51, 219, 217, 218, 280, 241, 282, 425, 426, 427, 428, 429, 430, 431, 432, 433,
        442, 104, 294, 105, 273, 106, 92, 279, 447, 194, 186, 180)),
}
NS_FLAGS = 0x20000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x80
AF_UNIX = 1
SECCOMP_RET = {"allow": 0x7FFF0000, "eperm": 0x00050000 | 1, "enosys": 0x00050000 | 38, "kill": 0x80000000}


def seccomp_program(table: dict, *, x32: bool) -> list[tuple[int, int, int, int]]:
    """The BPF filter as (code, jt, jf, k); jump targets are written as labels and resolved here.
    Order: arch check, the blocked calls, clone3, socket families, clone's namespace flags."""
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ/JGE/JSET|K, BPF_RET
    nr, arg0 = 0, 16  # offsets in struct seccomp_data (args[0]'s low word on a little-endian machine)
    code: list[tuple] = [(ld, None, None, 4), (jeq, None, "kill", table["arch"]), (ld, None, None, nr)]
    if x32:
        code.append((jge, "eperm", None, 0x40000000))  # the x32 ABI's numbers
    code += [(jeq, "eperm", None, call) for call in table["calls"]]
    code += [(jeq, "enosys", None, table["clone3"]),
             (jeq, "family", None, table["socket"]), (jeq, "family", None, table["socketpair"]),
             (jeq, None, "allow", table["clone"]), (ld, None, None, arg0), (jset, "eperm", "allow", NS_FLAGS),
             ("family",), (ld, None, None, arg0), (jeq, "allow", "eperm", AF_UNIX)]
    labels, body = {}, []
    for ins in code:
        if len(ins) == 1:
            labels[ins[0]] = len(body)
        else:
            body.append(ins)
    for name in SECCOMP_RET:
        labels[name] = len(body) + list(SECCOMP_RET).index(name)
    prog = []
    for i, (op, jt, jf, k) in enumerate(body):
        to = lambda target: 0 if target is None else labels[target] - i - 1  # noqa: E731 - relative jump
        prog.append((op, to(jt), to(jf), k))
    return prog + [(ret, 0, 0, value) for value in SECCOMP_RET.values()]


def install_seccomp() -> None:
    table = BLOCKED.get(platform.machine())
    if table is None:  # the namespaces and the uid still hold; this wall is skipped
        return
    prog = seccomp_program(table, x32=platform.machine() == "x86_64")

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
