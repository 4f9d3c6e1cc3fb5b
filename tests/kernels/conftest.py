"""Shared fixtures for the kernel tests. Tests that build or run Mojo carry ``@pytest.mark.mojo``
and are skipped when the ``mojo`` package is not importable (or MATERL_DISABLE_MOJO is set)."""

import importlib.util

import pytest
import torch

from materl.kernels import loader

HAS_MOJO = importlib.util.find_spec("mojo") is not None and not loader.disabled()

needs_mojo = pytest.mark.skipif(not HAS_MOJO, reason="needs the mojo package (pip install 'materl[mojo]')")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "mojo" in item.keywords and not HAS_MOJO:
            item.add_marker(needs_mojo)


@pytest.fixture
def fresh_loader():
    """A loader with nothing probed, loaded or warned yet; restored afterwards."""
    loader.reset()
    yield loader
    loader.reset()


@pytest.fixture
def temp_cache(tmp_path, monkeypatch, fresh_loader):
    """MATERL_CACHE_DIR pointed at an empty temporary directory."""
    root = tmp_path / "cache"
    monkeypatch.setenv("MATERL_CACHE_DIR", str(root))
    return root


def uneven_mask(B: int, T: int, dtype=torch.float64) -> torch.Tensor:
    """Rows of lengths T, T//2, 0, 1, T-1, ... (a fully masked row included)."""
    pattern = [T, T // 2, 0, 1, T - 1]
    lengths = torch.tensor([pattern[b % len(pattern)] for b in range(B)])
    return (torch.arange(T)[None, :] < lengths[:, None]).to(dtype)

