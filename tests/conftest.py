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


# Modules that start a local Ray cluster (or learner ranks, or a Ray sweep): under ``pytest -n N``
# they share one worker, one after another, so that two clusters never compete for the machine.
RAY_MODULES = {
    "tests/compiler/test_infra_failures.py", "tests/distributed/test_cost_model.py",
    "tests/distributed/test_learner_ranks.py", "tests/distributed/test_ray_group.py",
    "tests/distributed/test_ray_workers.py", "tests/faults/test_rendezvous.py", "tests/faults/test_signals.py",
    "tests/faults/test_tools_cluster.py", "tests/runtime/test_config.py", "tests/runtime/test_signals.py",
    "tests/runtime/test_sweep.py", "tests/runtime/test_train.py",
}

PER_TEST = {"tests/test_docs.py"}  # long and without module fixtures: each page its own unit


def pytest_collection_modifyitems(config, items):
    # ``--dist loadgroup`` (the README's test command): a module is one unit of work (a docs page is one too), so its
    # module-scoped fixtures are built once; the Ray modules are one unit together.
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        if item.get_closest_marker("xdist_group") is None:
            unit = "ray" if module in RAY_MODULES else item.nodeid if module in PER_TEST else module
            item.add_marker(pytest.mark.xdist_group(unit))
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not "gpu" in keywords: a folder named gpu matches that
            item.add_marker(skip_gpu)
