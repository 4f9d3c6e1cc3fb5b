"""materl's CPU tensors in an address range of their own, apart from glibc's heap.

    from materl import cpu_allocator
    cpu_allocator.install()        # True, or False with the reason in cpu_allocator.unavailable()
    with cpu_allocator.scope():    # this thread's tensors come from the range (compute work does this)
        x = torch.empty(1 << 20)
    cpu_allocator.stats()          # {"in_use": ..., "peak_in_use": ..., "top": ..., ...} in bytes

Why. With glibc, a training step's tensors share the heap with the small C++ objects autograd
makes as the forward runs (graph nodes, saved-variable records: thousands of 32-992 byte blocks
that live until the backward). They land between the activations, so when the backward frees
the activations the space they leave is cut into pieces smaller than the next layer's weight
gradients, which then go to fresh memory: full fine-tuning of SmolLM2-135M kept ~360 MiB free
inside a 1.7 GiB heap at the end of every backward (benchmarks/RESULTS.md, ``## vs_trl``). Here
every CPU tensor of 4 KiB or more comes from one reserved range, best fit with free neighbours
merged at once, and the small objects stay in glibc's heap: the freed activations stay whole and
the gradients reuse them. Same steps: 2555 MiB peak RSS instead of 2824-2865 (with AdamW's
state made ahead, ``compiler.compiled.init_adamw_state``).

Whose tensors. Only those a thread allocates inside ``scope()``; ``materl.compute`` runs every
work item (decoding, the learner, loading models) in one. Other code in the process keeps
glibc: TRL alternating with materl in one process (``benchmarks/vs_trl.py``) ran ~1 s a step
faster on the range, which TRL as shipped does not have.

How. ``cpu_allocator.cpp`` subclasses ``c10::Allocator`` and installs it with
``c10::SetCPUAllocator``; torch 2.13 offers that from C++ only. It is compiled on first use with
the system's C++ compiler (``$CXX``, else ``c++``/``g++``) against the installed torch's headers
and ``libc10``, into ``$MATERL_CACHE_DIR/native/<torch version>/<source hash>/`` (default
``~/.cache/materl``; about a second, once). Tensors allocated before ``install`` keep their own
deleter; tensors under 4 KiB, those allocated outside a scope, and any once the range is full
still come from glibc. ``torch.profiler``'s memory events are reported as by torch's own
allocator.

Reserved: twice the machine's RAM of address space, ``MAP_NORESERVE``; only written pages count.
Freed memory stays with the process for reuse, as torch's CUDA caching allocator keeps GPU
memory: giving a free top of the range back to the OS past 1 GiB, as glibc does, made materl
refault ~600 MiB every step when TRL and materl alternate in one process (``vs_trl.py``).

Where no compiler or no torch headers are found, or the build fails, ``install`` returns False
and says why in ``unavailable()``; glibc serves everything, as before. ``MATERL_MALLOC=glibc``
skips this allocator (``compute.tune_allocator`` still tunes glibc); ``MATERL_MALLOC=default``
skips both.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path

SOURCE = Path(__file__).with_name("cpu_allocator.cpp")
BUILD_TIMEOUT_S = 300
STATS = ("in_use", "peak_in_use", "top", "free_blocks")

_lib: ctypes.CDLL | None = None
_why_not = "not installed yet"


@functools.cache
def install() -> bool:
    """Make this process's torch CPU allocations come from materl's range (once). True if it is
    installed (now or earlier); False with the reason in ``unavailable()``."""
    global _lib, _why_not
    if os.environ.get("MATERL_MALLOC", "").lower() in ("default", "glibc"):
        _why_not = f"MATERL_MALLOC={os.environ['MATERL_MALLOC']}"
        return False
    try:
        path = _build()
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        _why_not = str(e)
        return False
    lib.materl_cpu_allocator_install.argtypes = [ctypes.c_uint64]
    lib.materl_cpu_allocator_owns.argtypes = [ctypes.c_uint64]
    lib.materl_cpu_allocator_stats.argtypes = [ctypes.POINTER(ctypes.c_uint64)]
    reserve = 2 * os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    rc = lib.materl_cpu_allocator_install(ctypes.c_uint64(reserve))
    if rc != 0:
        _why_not = f"reserving {reserve >> 30} GiB of address space failed" if rc == 1 else "pthread_atfork failed"
        return False
    _lib, _why_not = lib, ""
    return True


@contextmanager
def scope():
    """Inside, this thread's CPU tensors come from the range (when installed). Nests."""
    if _lib is None:
        yield
        return
    _lib.materl_cpu_allocator_enter()
    try:
        yield
    finally:
        _lib.materl_cpu_allocator_exit()


def unavailable() -> str | None:
    """Why the allocator is not installed; None when it is."""
    return None if _lib is not None else _why_not


def owns(tensor) -> bool:
    """True when ``tensor``'s memory comes from the range (False when not installed)."""
    return _lib is not None and bool(_lib.materl_cpu_allocator_owns(ctypes.c_uint64(tensor.data_ptr())))


def stats() -> dict[str, int]:
    """Bytes in live blocks (``in_use``), their peak since the last call (``peak_in_use``), the
    end of the used range (``top``: it never comes down, and the pages below it stay resident once
    written) and the count of free blocks. Empty when not installed."""
    if _lib is None:
        return {}
    out = (ctypes.c_uint64 * len(STATS))()
    _lib.materl_cpu_allocator_stats(out)
    return dict(zip(STATS, out))


def _build() -> Path:
    """The compiled library, from the cache or built now. Raises RuntimeError saying why not."""
    import torch

    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise RuntimeError("no C++ compiler found ($CXX, c++ or g++)")
    include, lib_dir = Path(torch.__file__).parent / "include", Path(torch.__file__).parent / "lib"
    if not (include / "c10" / "core" / "Allocator.h").is_file():
        raise RuntimeError(f"torch's C++ headers are missing from {include}")
    source = SOURCE.read_bytes()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    flags = ["-O2", "-std=c++17", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    digest = hashlib.sha256(b"\0".join([source, cxx.encode(), *map(str.encode, flags)])).hexdigest()[:16]
    base = os.environ.get("MATERL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "materl")
    out = Path(base) / "native" / torch.__version__ / digest / "libmaterl_cpu_allocator.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".cpu_allocator.", suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        cmd = [cxx, *flags, "-I", str(include), str(SOURCE), "-L", str(lib_dir), "-lc10",
               f"-Wl,-rpath,{lib_dir}", "-o", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{cxx} failed to build {SOURCE.name} (exit {proc.returncode}): "
                               f"{(proc.stderr or proc.stdout).strip()[-2000:]}")
        os.replace(tmp, out)  # atomic: concurrent processes may build at once
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return out
