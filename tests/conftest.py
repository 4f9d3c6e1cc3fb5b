import os

os.environ.setdefault("MODULAR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest -n N: one core a worker, for its own torch and its children
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch
from hypothesis import settings

# CI (CI=true) draws the same examples every run: a property test fails there only for a change,
# never for a draw; elsewhere every run explores new examples (and replays saved failures).
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


PER_TEST = {"tests/test_docs.py"}  # long and without module fixtures: each page its own unit


def unit_of(nodeid: str) -> str:
    """The unit of work ``pytest -n N --dist loadgroup`` (the README's test command) gives one worker
    whole: its module, so that module-scoped fixtures are built once; each docs page alone. Modules
    that start a local Ray cluster or learner ranks may run beside each other on the two workers, as
    they did in every CI run before this scheduler existed (the suite's longest unit stays one module)."""
    module = nodeid.split("::", 1)[0]
    return nodeid.split("@", 1)[0] if module in PER_TEST else module


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` by ``unit_of`` the test ids. (Not by ``xdist_group`` markers: xdist 3.8 turns
    them into a test-id suffix, which pytest 9.2's test ids no longer take, pytest-xdist#1386; every
    test then went to the workers alone, each worker building every module fixture again.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return ByUnit(config, log)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not "gpu" in keywords: a folder named gpu matches that
            item.add_marker(skip_gpu)
