"""Build Mojo sources into shared libraries on first use, cache them, and load them with ctypes.

    kernel = load("rewards")                # kernels/rewards.mojo, or None (torch runs instead)
    kernel.call("length_reward", "iiiifi", lengths.data_ptr(), B, lo, hi, scale, out.data_ptr())

Calling convention (every kernel, built-in or a user's): a Mojo function exported with the C ABI,
``@export def name(a: Int, b: Float64, ...) abi("C") -> Int``. ``Int`` arguments carry buffer
addresses (``tensor.data_ptr()``, zero-copy) and sizes; ``Float64`` arguments carry real
hyperparameters; the result is 0 on success and non-zero for an error the kernel detected.
ctypes releases the GIL for the call, so kernels run while other Python threads work.

Why a C-ABI shared library rather than ``mojo.importer``'s Python extension module: the library
does not link against CPython (one build serves every Python version), a call is one ctypes
trampoline (~1-2 us) without PythonObject conversions, and a user kernel needs no
``PyInit_*`` / ``PythonModuleBuilder`` boilerplate.

Cache: ``$MATERL_CACHE_DIR/mojo/<mojo-version>-<cpu-target>/<source-hash>/<stem>.so``
(``MATERL_CACHE_DIR`` defaults to ``~/.cache/materl``). ``<mojo-version>`` is ``mojo --version``
(release and build hash), ``<cpu-target>`` the triple, CPU and a hash of the CPU features from
``mojo build --print-effective-target``, ``<source-hash>`` a hash of the source text and the build
flags. A kernel file may import Mojo packages that sit beside it (a folder with ``__init__.mojo``,
e.g. ``kernels/llama/``): it is built with ``-I`` its folder, and the hash covers every ``.mojo``
file of the packages it imports. A changed source, compiler or CPU gets a new directory; nothing
is ever written next to the sources. Builds go to a temporary file renamed into place, so concurrent processes are safe.
(The stock ``mojo.importer`` keys its cache on the source only and writes ``__mojocache__`` into
the source tree.) Modular's own compiler caches stay where ``MODULAR_CACHE_DIR`` puts them.

Fallback: when ``mojo`` is not installed, cannot run, or a build fails, ``load`` returns None and
emits ONE ``MojoFallbackWarning`` per kernel saying why; callers then run their torch
implementation. ``MATERL_DISABLE_MOJO=1`` forces torch everywhere (silently: it was asked for).
``status()`` shows, per op, which implementation runs and why.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.resources
import os
import re
import shutil
import subprocess
import tempfile
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from materl.errors import KernelError

# contract=off: no FMA fusion across statements, so a kernel rounds like the torch ops it reproduces
BUILD_FLAGS = ("--emit", "shared-lib", "-O3", "--fp-mode", "contract=off")
BUILD_TIMEOUT_S = 600

#: Which kernel file serves each op (``status()`` reports these).
KERNEL_OPS = {
    "repetition": "rewards",
    "diversity": "rewards",
    "length": "rewards",
    "pattern_match": "rewards",
    "reward_chain": "rewards",
    "sentiment": "text_rewards",
    "toxicity": "text_rewards",
    "policy_loss": "policy_loss",
    "grpo_advantages": "advantages",
    "rloo_advantages": "advantages",
}


class MojoFallbackWarning(RuntimeWarning):
    """A Mojo kernel is unavailable; the torch implementation runs instead."""


@functools.lru_cache(maxsize=1)
def kernel_dir() -> Path:
    """The directory holding the shipped ``*.mojo`` sources: the installed package
    ``materl.kernel_sources``, or, for materl imported from a source checkout that was never
    pip-installed, the checkout's top-level ``kernels/`` folder."""
    try:
        return Path(str(importlib.resources.files("materl.kernel_sources")))
    except ModuleNotFoundError:  # a plain checkout on sys.path: kernels/ sits beside materl/
        return Path(__file__).resolve().parents[2] / "kernels"


def cache_root() -> Path:
    """``$MATERL_CACHE_DIR/mojo`` (default ``~/.cache/materl/mojo``)."""
    base = os.environ.get("MATERL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "materl")
    return Path(base) / "mojo"


def disabled() -> bool:
    """True when ``MATERL_DISABLE_MOJO`` is set to anything but '', 0, false or no."""
    return os.environ.get("MATERL_DISABLE_MOJO", "").strip().lower() not in ("", "0", "false", "no")


# ----------------------------------------------------------------------------- the toolchain


def _run_mojo(args: list[str], *, timeout: float) -> subprocess.CompletedProcess:
    """Run the ``mojo`` driver of the installed ``mojo`` package, telemetry off. Raises ImportError
    (package missing), RuntimeError (no executable) or subprocess errors."""
    from mojo import run as mojo_run  # noqa: PLC0415  (optional dependency)

    # the package's own environment (SDK paths under the ambient variables), as mojo.importer uses
    env = dict(getattr(mojo_run, "_mojo_env", lambda: os.environ)())
    env["MODULAR_TELEMETRY_ENABLED"] = "0"
    exe = env.get("MODULAR_MOJO_MAX_DRIVER_PATH") or shutil.which("mojo")
    if not exe or not os.path.exists(exe):
        raise RuntimeError("the mojo package is installed but its `mojo` executable was not found")
    return subprocess.run([exe, *args], env=env, capture_output=True, check=False, timeout=timeout)


@dataclass(frozen=True)
class Toolchain:
    """The Mojo compiler and the CPU it targets: the first part of every cache key."""

    version: str  # e.g. "1.2.0-2016d0cd"
    target: str  # e.g. "x86_64-znver4-1a2b3c4d"

    @property
    def key(self) -> str:
        return f"{self.version}-{self.target}"


_toolchain: Toolchain | str | None = None  # a Toolchain, or the reason there is none
_lock = threading.RLock()


def _probe() -> Toolchain | str:
    try:
        ver = _run_mojo(["--version"], timeout=60)
        tgt = _run_mojo(["build", "--print-effective-target"], timeout=60)
    except ImportError:
        return "the 'mojo' package is not installed (pip install 'materl[mojo]')"
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        return f"the mojo compiler cannot run: {e}"
    if ver.returncode != 0 or tgt.returncode != 0:
        err = (ver.stderr or tgt.stderr or b"").decode(errors="replace").strip()
        return f"the mojo compiler cannot run: {err[:300]}"
    m = re.search(r"(\d+\.\d+\.\d+\S*)(?:\s+\((\w+)\))?", ver.stdout.decode())
    version = (m.group(1) + (f"-{m.group(2)}" if m.group(2) else "")) if m else "unknown"
    text = tgt.stdout.decode()
    triple = re.search(r"--target-triple\s+(\S+)", text)
    cpu = re.search(r"--target-cpu\s+(\S+)", text)
    feats = re.search(r"--target-features\s+(\S+)", text)
    arch = triple.group(1).split("-")[0] if triple else "unknown"
    fhash = hashlib.sha256((feats.group(1) if feats else "").encode()).hexdigest()[:8]
    target = f"{arch}-{cpu.group(1) if cpu else 'unknown'}-{fhash}"
    return Toolchain(_safe(version), _safe(target))


def _safe(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._+-]", "_", s)


def toolchain() -> Toolchain:
    """The installed Mojo compiler and host target (probed once per process). Raises KernelError
    saying why when Mojo cannot be used (not installed, disabled, broken)."""
    global _toolchain
    if disabled():
        raise KernelError("Mojo kernels are disabled by MATERL_DISABLE_MOJO=1")
    with _lock:
        if _toolchain is None:
            _toolchain = _probe()
        if isinstance(_toolchain, str):
            raise KernelError(_toolchain)
        return _toolchain


def reset() -> None:
    """Forget the probed toolchain, loaded kernels and warnings (tests; after installing mojo)."""
    global _toolchain
    with _lock:
        _toolchain = None
        _by_hash.clear()
        _failed.clear()
        _by_path.clear()
        _warned.clear()
        _files.clear()
        _imports.clear()


# ----------------------------------------------------------------------------- kernels


@dataclass
class Kernel:
    """A built shared library; ``function(symbol, signature)`` returns a ctypes callable whose
    arguments are given by ``signature``: one letter per argument, ``i`` (Int: int64, addresses
    and sizes) or ``f`` (Float64). Every exported function returns Int (0 = success)."""

    name: str
    path: Path
    source_hash: str
    lib: ctypes.CDLL = field(repr=False)
    _fns: dict = field(default_factory=dict, repr=False)

    def function(self, symbol: str, signature: str):
        key = (symbol, signature)
        fn = self._fns.get(key)
        if fn is None:
            try:
                fn = getattr(self.lib, symbol)
            except AttributeError:
                raise KernelError(
                    f"kernel {self.name!r} ({self.path}) exports no function {symbol!r}; mark it "
                    f"'@export def {symbol}(...) abi(\"C\") -> Int'"
                ) from None
            types = {"i": ctypes.c_int64, "f": ctypes.c_double}
            bad = set(signature) - set(types)
            if bad:
                raise KernelError(f"signature {signature!r} for {symbol!r}: letters must be i (Int) or f (Float64)")
            fn.argtypes = [types[c] for c in signature]
            fn.restype = ctypes.c_int64
            self._fns[key] = fn
        return fn

    def call(self, symbol: str, signature: str, *args) -> None:
        """Call ``symbol`` and raise KernelError if it returns non-zero."""
        rc = self.function(symbol, signature)(*args)
        if rc != 0:
            raise KernelError(f"kernel {self.name}.{symbol} returned error code {rc}")


_by_hash: dict[str, Kernel] = {}  # source hash -> loaded kernel
_failed: dict[str, str] = {}  # source hash -> why its build failed
_by_path: dict[Path, tuple[tuple, Kernel]] = {}  # source file -> (stat keys of it and its packages, kernel)
_files: dict[Path, tuple[tuple[int, int], str]] = {}  # source path -> (stat key, text)
_imports: dict[Path, tuple] = {}  # source path -> (its stat key, package files, [(package folder, stat key)])
_warned: set[str] = set()


def source_hash(source: str, packages: tuple[str, ...] = ()) -> str:
    """Hash of the build flags, ``source`` and the text of the packages it imports."""
    h = hashlib.sha256()
    h.update(" ".join(BUILD_FLAGS).encode())
    h.update(b"\0")
    h.update(source.encode())
    for text in packages:
        h.update(b"\0")
        h.update(text.encode())
    return h.hexdigest()[:16]


def imported_packages(source: str, folder: Path) -> list[Path]:
    """The ``.mojo`` files of the packages beside ``folder``'s file that ``source`` imports (a
    folder with ``__init__.mojo``), sorted; a package's own files may import nothing else local."""
    names = set(re.findall(r"^\s*(?:from|import)\s+([A-Za-z_]\w*)", source, re.MULTILINE))
    files: list[Path] = []
    for name in sorted(names):
        if (folder / name / "__init__.mojo").is_file():
            files += sorted((folder / name).rglob("*.mojo"))
    return files


def build_dir(source: str, packages: tuple[str, ...] = ()) -> Path:
    """Where ``source`` is (or will be) built: ``cache_root()/<toolchain>/<source hash>``."""
    return cache_root() / toolchain().key / source_hash(source, packages)


def compile_source(stem: str, source: str, *, origin: str | os.PathLike | None = None,
                   include: Path | None = None) -> Kernel:
    """Build ``source`` (Mojo text) as ``<stem>.so`` in the cache unless already built, and load it.

    ``include``: a folder whose Mojo packages ``source`` may import (built with ``-I include``;
    the packages' text is part of the cache key). Raises KernelError carrying the compiler's
    message when Mojo is unavailable or the build fails (its file locations name ``origin``, the
    file the source came from, when given).
    """
    packages = tuple(read_source(f) for f in imported_packages(source, include)) if include is not None else ()
    digest = source_hash(source, packages)
    with _lock:
        cached = _by_hash.get(digest)
        if cached is not None:
            return cached
        if digest in _failed:  # a failed build is not retried in this process
            raise KernelError(_failed[digest])
        out = build_dir(source, packages) / f"{_safe(stem)}.so"
        if not out.is_file():
            try:
                _build(stem, source, out, origin, include)
            except KernelError as e:
                _failed[digest] = str(e)
                raise
        try:
            lib = ctypes.CDLL(str(out))
        except OSError as e:
            raise KernelError(f"built kernel {out} does not load: {e}") from e
        kernel = Kernel(stem, out, digest, lib)
        _by_hash[digest] = kernel
        return kernel


def _build(stem: str, source: str, out: Path, origin: str | os.PathLike | None, include: Path | None) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    src = out.with_suffix(".mojo")
    if not src.is_file():
        _atomic_write(src, source.encode())
    fd, tmp = tempfile.mkstemp(prefix=f".{out.stem}.", suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        includes = ["-I", str(include)] if include is not None else []
        proc = _run_mojo(["build", str(src), *includes, *BUILD_FLAGS, "-o", tmp], timeout=BUILD_TIMEOUT_S)
        if proc.returncode != 0:
            msg = (proc.stderr or b"").decode(errors="replace").strip() or (proc.stdout or b"").decode(errors="replace")
            if origin is not None:
                msg = msg.replace(str(src), str(origin))
            raise KernelError(f"mojo build of {str(origin or stem)!r} failed (exit {proc.returncode}):\n{msg}")
        os.replace(tmp, out)
    except KernelError:
        raise
    except subprocess.TimeoutExpired:
        raise KernelError(f"mojo build of {stem!r} ran past {BUILD_TIMEOUT_S} s") from None
    except (ImportError, RuntimeError, OSError) as e:
        raise KernelError(f"mojo build of {stem!r} could not run: {e}") from e
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _stat_key(path: Path) -> tuple[int, int]:
    try:
        st = path.stat()
    except FileNotFoundError:
        raise KernelError(f"Mojo source not found: {path}") from None
    return st.st_mtime_ns, st.st_size


def read_source(path: Path) -> str:
    """The text of a .mojo file, re-read only when its size or mtime changed."""
    path = Path(path)
    key = _stat_key(path)
    hit = _files.get(path)
    if hit is not None and hit[0] == key:
        return hit[1]
    text = path.read_text()
    _files[path] = (key, text)
    return text


def compile_file(path: str | os.PathLike) -> Kernel:
    """Build and load one .mojo file and the sibling packages it imports (raises KernelError on
    a missing file or build error). A call on unchanged files costs one stat per file and per
    package folder: the packages a source imports are found again only when the source or a
    package folder changed (a file added to, removed from or renamed in a package)."""
    path = Path(path)
    own = _stat_key(path)
    found = _imports.get(path)
    if found is None or found[0] != own or any(_stat_key(d) != k for d, k in found[2]):
        files = imported_packages(read_source(path), path.parent)
        found = _imports[path] = (own, files, [(d, _stat_key(d)) for d in _folders(files, path.parent)])
    key = (own, *(_stat_key(f) for f in found[1]))
    hit = _by_path.get(path)
    if hit is not None and hit[0] == key:  # unchanged files: skip re-reading and hashing
        return hit[1]
    kernel = compile_source(path.stem, read_source(path), origin=path, include=path.parent)
    _by_path[path] = (key, kernel)
    return kernel


def _folders(files: list[Path], folder: Path) -> list[Path]:
    """``folder`` (a package appears in it) and every folder holding one of the package ``files``."""
    return [folder, *sorted({f.parent for f in files})]


def load(name: str) -> Kernel | None:
    """The built kernel ``kernels/<name>.mojo``, or None when Mojo cannot be used (torch runs).

    Builds on first use (seconds; cached across processes afterwards). On failure emits one
    ``MojoFallbackWarning`` per kernel name saying why, and returns None.
    """
    return load_or_reason(name)[0]


def load_or_reason(name: str) -> tuple[Kernel | None, str]:
    """``(kernel, "")`` or ``(None, why)``; warns once per kernel as ``load`` does."""
    if disabled():
        return None, "MATERL_DISABLE_MOJO=1"
    try:
        return compile_file(kernel_dir() / f"{name}.mojo"), ""
    except KernelError as e:
        why = str(e)
    warn_once(name, why)
    return None, why


def warn_once(name: str, why: str) -> None:
    """Emit the one ``MojoFallbackWarning`` for kernel ``name`` (later calls are silent)."""
    with _lock:
        first = name not in _warned
        _warned.add(name)
    if first:
        warnings.warn(
            f"materl: Mojo kernel {name!r} unavailable, using the torch implementation: {why}",
            MojoFallbackWarning,
            stacklevel=4,
        )


# ----------------------------------------------------------------------------- status


def status() -> dict[str, str]:
    """Per op, ``"mojo"`` or ``"torch (<reason>)"``. Builds kernels not built yet (seconds)."""
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MojoFallbackWarning)
        for op, name in KERNEL_OPS.items():
            kernel, why = load_or_reason(name)
            out[op] = "mojo" if kernel is not None else f"torch ({_first_line(why)})"
    return out


def _first_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[0] if lines else text


def status_table() -> str:
    """``status()`` as a printable two-column table, with the toolchain and cache directory."""
    rows = status()
    width = max(len(op) for op in rows)
    lines = [f"{'op'.ljust(width)}  implementation", f"{'-' * width}  {'-' * 14}"]
    lines += [f"{op.ljust(width)}  {impl}" for op, impl in rows.items()]
    try:
        lines.append(f"mojo {toolchain().key}; cache {cache_root()}")
    except KernelError as e:
        lines.append(f"mojo unavailable: {_first_line(str(e))}")
    return "\n".join(lines)
