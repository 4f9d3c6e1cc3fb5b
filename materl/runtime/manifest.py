"""A checkpoint's manifest: the size and SHA-256 of every file, written last, checked on load.

    write_manifest(folder)            # after every other file of the checkpoint is written
    verify(folder)                    # CheckpointError naming the first file that does not match

``manifest.json`` lists each file under the checkpoint folder (relative path -> size, sha256)
and is written last, atomically (temp file, fsync, ``os.replace``), inside the temp folder that
is renamed into place: a ``step-*`` folder with a manifest is complete, and every byte of it is
covered. Why SHA-256: it catches a truncated, zeroed or bit-flipped file (one changed float, one
byte of an RNG state) as surely as any hash, ``sha256sum`` checks it from a shell, and with the
SHA extensions that x86 and ARM CPUs have had for years OpenSSL (hashlib) hashes at 0.4-2 GB/s,
so a 500 MB model adds about a second to a save and to a resume; CRC32 is 2-3x faster but only
32 bits, BLAKE2b (no hardware support) is slower here (measured on this machine: 370 MB/s
SHA-256, 170 MB/s BLAKE2b, 940 MB/s CRC32, both cores busy). (verl and TRL checkpoints carry no
checksums; safetensors checks its header but not the data.)
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from materl.errors import CheckpointError

MANIFEST = "manifest.json"
ALGORITHM = "sha256"


def file_digest(path: Path) -> str:
    """The hex SHA-256 of a file's bytes."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, ALGORITHM).hexdigest()


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def build_manifest(folder: Path) -> dict:
    """``{"algorithm": "sha256", "files": {relative path: {"size": bytes, "sha256": hex}}}``."""
    files = {}
    for rel in _files(folder):
        path = folder / rel
        files[rel] = {"size": path.stat().st_size, ALGORITHM: file_digest(path)}
    return {"algorithm": ALGORITHM, "files": files}


def write_manifest(folder: Path, write_text) -> None:
    """Hash every file of ``folder`` and write ``manifest.json`` with ``write_text(path, text)``
    (the checkpoint's atomic writer); call it after every other file is written."""
    write_text(folder / MANIFEST, json.dumps(build_manifest(folder), indent=1, sort_keys=True))


def has_manifest(folder: Path) -> bool:
    return (folder / MANIFEST).is_file()


def verify(folder: Path, *, hashes: bool = True) -> None:
    """Check every file against ``folder/manifest.json``; CheckpointError naming the first file
    that is missing, has another size or another SHA-256, or leads outside ``folder``, or what
    makes the manifest unreadable (``read_manifest``). ``hashes=False`` checks the manifest
    and the paths only."""
    where = f"checkpoint {str(folder)!r}"
    files = read_manifest(folder)
    for rel, (expected_size, expected_digest) in sorted(files.items()):
        path = confined(folder, rel, what="manifest entry")
        if not path.is_file():
            raise CheckpointError(f"{where}: file {rel} is missing (the manifest lists it)")
        if not hashes:
            continue
        size = path.stat().st_size
        if size != expected_size:
            raise CheckpointError(f"{where}: file {rel} has {size} bytes, the manifest says {expected_size} "
                                  f"(truncated or overwritten)")
        digest = file_digest(path)
        if digest != expected_digest:
            raise CheckpointError(f"{where}: file {rel} does not match its {ALGORITHM} in the manifest "
                                  f"({digest[:12]}... instead of {expected_digest[:12]}...): its bytes changed")
    extra = sorted(set(_files(folder)) - set(files))
    if extra:
        raise CheckpointError(f"{where}: file {extra[0]} is not in the manifest (added after the save)")


_HEX = re.compile(r"[0-9a-f]{64}")


def read_manifest(folder: Path) -> dict[str, tuple[int, str]]:
    """``folder/manifest.json`` as relative path -> (size, sha256), checked against the schema
    ``build_manifest`` writes: an object with ``algorithm`` "sha256" and ``files``, an object
    whose every entry is an object with exactly an int ``size`` >= 0 and a 64-hex ``sha256``.
    Anything else (unreadable, not JSON, files as a list, an entry as a string or without its
    sha256) is a damaged checkpoint: CheckpointError naming what is wrong."""
    where = f"checkpoint {str(folder)!r}: {MANIFEST}"
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{where} is missing or unreadable ({exc})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        got = type(manifest.get("files")).__name__ if isinstance(manifest, dict) else f"a JSON {type(manifest).__name__}"
        raise CheckpointError(f"{where} is malformed: expected an object with 'files' an object of path -> "
                              f"{{size, {ALGORITHM}}}, got {got}")
    if manifest.get("algorithm", ALGORITHM) != ALGORITHM:
        raise CheckpointError(f"{where} uses checksum {manifest.get('algorithm')!r}; this materl checks {ALGORITHM}")
    files = {}
    for rel, entry in manifest["files"].items():
        if not (isinstance(entry, dict) and set(entry) == {"size", ALGORITHM}
                and type(entry["size"]) is int and entry["size"] >= 0
                and isinstance(entry[ALGORITHM], str) and _HEX.fullmatch(entry[ALGORITHM])):
            raise CheckpointError(f"{where} is malformed: entry {rel!r} is {json.dumps(entry)[:200]}; expected "
                                  f'{{"size": <int >= 0>, "{ALGORITHM}": <64 hex digits>}}')
        files[rel] = (entry["size"], entry[ALGORITHM])
    return files


def confined(folder: Path, rel: str, *, what: str) -> Path:
    """``folder / rel`` where ``rel`` is a relative path that stays inside ``folder``, symlinks
    followed; CheckpointError for an absolute path, ``..``, an empty part, or a symlink that
    leads out (a checkpoint reads only its own files)."""
    parts = rel.split("/")
    if not rel or rel.startswith("/") or "\\" in rel or "\0" in rel or any(p in ("", ".", "..") for p in parts):
        raise CheckpointError(f"checkpoint {str(folder)!r}: {what} {rel!r} is not a path inside the checkpoint "
                              f"folder (absolute, or with '..', '.' or empty parts)")
    path = folder / rel
    real, base = path.resolve(), folder.resolve()
    if not real.is_relative_to(base):
        raise CheckpointError(f"checkpoint {str(folder)!r}: {what} {rel!r} leads outside the checkpoint folder "
                              f"(to {str(real)!r}, through a symlink)")
    return path


# ----------------------------------------------------------------------------- write failures


@contextmanager
def writing(path: Path) -> Iterator[None]:
    """Turn a failed write of ``path`` into the OSError behind it, with ``path`` as its filename.
    torch reports a full disk as ``unexpected pos 5184 vs 5076`` (the OSError is its context),
    safetensors as ``SafetensorError(... (os error 28))``."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None:
            raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from exc
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised unless an OS error is behind it
        code = _errno_behind(exc)
        if code is None:
            raise
        raise OSError(code, os.strerror(code), str(path)) from exc


def _errno_behind(exc: BaseException) -> int | None:
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e.errno
        m = re.search(r"\(os error (\d+)\)", str(e))
        if m:
            return int(m.group(1))
        e = e.__cause__ or e.__context__
    return None


def save_error(exc: OSError, root: Path, step: int, *, latest: str | None, estimate) -> CheckpointError:
    """What failed, where, and what is still there; for a full disk, how much a save needs: the
    size of the ``latest`` checkpoint, else ``estimate()`` bytes."""
    kept = f"the previous checkpoint {latest} is still the latest" if latest else "no earlier checkpoint exists"
    where = exc.filename or str(root)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        need = folder_bytes(root / latest) if latest else estimate()
        free = shutil.disk_usage(root).free
        return CheckpointError(f"checkpoint step {step} was not saved: the disk is full (errno {exc.errno}, "
                               f"{exc.strerror}) writing {where}; a checkpoint needs about {_mb(need)}, "
                               f"{_mb(free)} free on that filesystem. The temp folder was removed and {kept}")
    return CheckpointError(f"checkpoint step {step} was not saved: writing {where} failed ({exc.strerror or exc}). "
                           f"The temp folder was removed and {kept}")


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def folder_bytes(folder: Path) -> int:
    """Total size of the files under ``folder`` (0 if it does not exist)."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0
