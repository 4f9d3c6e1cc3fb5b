"""The kernel loader: cache layout and keys, rebuilds, fallback warnings, status."""

import re
import sys
import warnings

import pytest
import torch

from materl.errors import KernelError
from materl.kernels import loader
from materl.kernels import rewards as R
from materl.kernels.loader import MojoFallbackWarning

TINY = '''
@export
def answer(out_addr: Int) abi("C") -> Int:
    var out = Pointer[Int64, MutUntrackedOrigin](unsafe_from_address=out_addr)
    out[unsafe_offset=0] = {value}
    return 0
'''


def _answer(kernel: loader.Kernel) -> int:
    out = torch.zeros(1, dtype=torch.int64)
    kernel.call("answer", "i", out.data_ptr())
    return int(out[0])


@pytest.fixture
def count_builds(monkeypatch):
    calls = []
    real = loader._build

    def counting(stem, source, out, origin, include):
        calls.append(out)
        return real(stem, source, out, origin, include)

    monkeypatch.setattr(loader, "_build", counting)
    return calls


@pytest.mark.mojo
def test_cache_key_layout_and_nothing_written_next_to_the_source(tmp_path, temp_cache):
    src_dir = tmp_path / "src"
    src_dir.mkdir()
    src = src_dir / "tiny.mojo"
    src.write_text(TINY.format(value=42))
    kernel = loader.compile_file(src)
    assert _answer(kernel) == 42
    # <MATERL_CACHE_DIR>/mojo/<mojo-version>-<cpu-target>/<source-hash>/tiny.so
    rel = kernel.path.relative_to(temp_cache / "mojo")
    toolchain, digest, name = rel.parts
    assert name == "tiny.so" and digest == loader.source_hash(src.read_text())
    assert re.fullmatch(r"\d+\.\d+\.\d+[^-]*(-\w+)?-\w+-[\w.+-]+-[0-9a-f]{8}", toolchain), toolchain
    assert toolchain.startswith(loader.toolchain().version)
    assert sorted(p.name for p in src_dir.iterdir()) == ["tiny.mojo"]  # no __mojocache__ in the tree


@pytest.mark.mojo
def test_rebuilt_when_the_source_changes_and_not_otherwise(tmp_path, temp_cache, count_builds):
    src = tmp_path / "tiny.mojo"
    src.write_text(TINY.format(value=1))
    first = loader.compile_file(src)
    assert _answer(first) == 1 and len(count_builds) == 1
    assert loader.compile_file(src) is first and len(count_builds) == 1  # same process: memo
    loader.reset()  # as a new process would: the disk cache is reused, no rebuild
    assert _answer(loader.compile_file(src)) == 1 and len(count_builds) == 1
    src.write_text(TINY.format(value=2))
    second = loader.compile_file(src)
    assert _answer(second) == 2 and len(count_builds) == 2
    assert second.path.parent != first.path.parent
    src.write_text(TINY.format(value=1))  # back to the first text: its build is still cached
    loader.reset()
    assert _answer(loader.compile_file(src)) == 1 and len(count_builds) == 2


@pytest.mark.mojo
def test_a_file_added_to_an_imported_package_is_noticed_in_the_same_process(tmp_path, temp_cache, count_builds):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.mojo").write_text("")
    (tmp_path / "pkg" / "one.mojo").write_text("def value() -> Int64:\n    return 7\n")
    src = tmp_path / "main.mojo"
    src.write_text("from pkg.one import value\n" + TINY.format(value="value()"))
    first = loader.compile_file(src)
    assert _answer(first) == 7 and len(count_builds) == 1
    assert loader.compile_file(src) is first and len(count_builds) == 1  # nothing changed: the memo
    (tmp_path / "pkg" / "two.mojo").write_text("def other() -> Int64:\n    return 8\n")  # the importer unchanged
    second = loader.compile_file(src)
    assert len(count_builds) == 2 and second.path.parent != first.path.parent  # the package's text is in the key
    loader.reset()  # a new process sees the same key, so builds nothing
    assert loader.compile_file(src).path == second.path and len(count_builds) == 2


def test_missing_mojo_falls_back_with_exactly_one_warning(monkeypatch, fresh_loader):
    monkeypatch.setitem(sys.modules, "mojo", None)  # `import mojo` now raises ImportError
    monkeypatch.setitem(sys.modules, "mojo.run", None)
    monkeypatch.delenv("MATERL_DISABLE_MOJO", raising=False)
    ids, lengths = R.pad_ids([[1, 2, 1, 2, 1], [7]])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = R.repetition(ids, lengths, n=2)
        second = R.repetition(ids, lengths, n=2)
        assert loader.load("rewards") is None
    fallback = [w for w in caught if issubclass(w.category, MojoFallbackWarning)]
    assert len(fallback) == 1
    assert "not installed" in str(fallback[0].message) and "'rewards'" in str(fallback[0].message)
    # n=2 windows of [1,2,1,2,1]: (1,2),(2,1),(1,2),(2,1) -> W=4, U=2 -> -0.5; [7] has no window -> 0
    assert first.tolist() == [-0.5, 0.0] and torch.equal(first, second)
    table = loader.status()
    assert set(table) == set(loader.KERNEL_OPS)
    assert all(v.startswith("torch (the 'mojo' package is not installed") for v in table.values())
    with pytest.raises(KernelError, match="not installed"):
        R.repetition(ids, lengths, impl="mojo")


def test_disable_env_forces_torch_silently(monkeypatch, fresh_loader):
    monkeypatch.setenv("MATERL_DISABLE_MOJO", "1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert loader.load("rewards") is None
        out = R.diversity(*R.pad_ids([[3, 3, 4]]))
    assert not [w for w in caught if issubclass(w.category, MojoFallbackWarning)]
    assert out.tolist() == [2 / 3]  # tokens 3,3,4: 2 distinct of 3
    assert loader.status() == dict.fromkeys(loader.KERNEL_OPS, "torch (MATERL_DISABLE_MOJO=1)")
    assert "MATERL_DISABLE_MOJO=1" in loader.status_table()


@pytest.mark.mojo
def test_failed_build_returns_none_warns_once_and_is_not_retried(tmp_path, monkeypatch, temp_cache, count_builds):
    (tmp_path / "broken.mojo").write_text('@export\ndef broken() abi("C") -> Int:\n    return undefined_name\n')
    monkeypatch.setattr(loader, "kernel_dir", lambda: tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert loader.load("broken") is None
        assert loader.load("broken") is None
    fallback = [w for w in caught if issubclass(w.category, MojoFallbackWarning)]
    assert len(fallback) == 1 and "undefined_name" in str(fallback[0].message)
    assert len(count_builds) == 1
    kernel, why = loader.load_or_reason("broken")
    assert kernel is None and "broken.mojo" in why


@pytest.mark.mojo
def test_status_reports_mojo_for_every_shipped_kernel(fresh_loader):
    table = loader.status()
    assert table == dict.fromkeys(loader.KERNEL_OPS, "mojo")
    text = loader.status_table()
    assert all(op in text for op in loader.KERNEL_OPS) and loader.toolchain().key in text


@pytest.mark.mojo
def test_kernel_function_errors_name_the_symbol(fresh_loader):
    kernel = loader.load("rewards")
    with pytest.raises(KernelError, match="no function 'nope'"):
        kernel.function("nope", "i")
    with pytest.raises(KernelError, match="letters must be i"):
        kernel.function("repetition", "ix")


def test_a_source_checkout_that_was_never_installed_still_falls_back(tmp_path):
    """materl imported from a copy of the package alone (no pip install, no kernels/ folder
    beside it): materl.kernel_sources does not exist, and impl="auto" takes the torch path
    instead of raising ModuleNotFoundError."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    shutil.copytree(Path(__file__).resolve().parents[2] / "materl", tmp_path / "materl",
                    ignore=shutil.ignore_patterns("__pycache__"))
    script = f"""
import sys
sys.meta_path[:] = [f for f in sys.meta_path if getattr(f, "__name__", "") != "_EditableFinder"]  # not installed
sys.path.insert(0, {str(tmp_path)!r})
import warnings, torch, materl
assert materl.__file__.startswith({str(tmp_path)!r}), materl.__file__
from materl.kernels.loader import kernel_dir
from materl.kernels.policy_loss import fused_policy_loss, policy_loss_torch
assert kernel_dir() == __import__("pathlib").Path({str(tmp_path)!r}) / "kernels"
args = [torch.randn(2, 3, dtype=torch.float64, requires_grad=True)] + [torch.randn(2, 3, dtype=torch.float64)] * 2 + [torch.ones(2, 3, dtype=torch.float64)]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    loss = fused_policy_loss(*args, impl="auto")
ref = policy_loss_torch(*args)
value = lambda x: x[0] if isinstance(x, tuple) else x
assert torch.allclose(value(loss), value(ref)), (loss, ref)
print("fell back:", [str(w.message)[:60] for w in caught])
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "MATERL_CACHE_DIR": str(tmp_path / "cache")})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "fell back" in out.stdout
