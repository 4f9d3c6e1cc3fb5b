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

# The longest units, longest first (from CI's --durations, benchmarks/RESULTS.md "test_suite"): they
# start first, so that the two workers end together instead of one finishing a 3-minute module
# alone (xdist's own order, most tests first, put these few-test modules last). Only the order
# depends on this list: a stale entry costs balance, never a test.
LONGEST_FIRST = (
    "tests/runtime/test_sweep.py", "tests/distributed/test_learner_ranks.py", "tests/distributed/test_ray_workers.py",
    "tests/test_docs.py", "tests/runtime/test_verifiers_env.py", "tests/faults/test_checkpoints.py",
    "tests/distributed/test_learner.py", "tests/faults/test_signals.py", "tests/faults/test_train_tools.py",
    "tests/test_self_play_example.py", "tests/faults/test_tools_cluster.py", "tests/test_reasoning_gym_example.py",
    "tests/runtime/test_smollm2.py", "tests/faults/test_inputs.py", "tests/engines/test_models.py",
    "tests/rollout/test_principles.py", "tests/test_openai_agent_example.py", "tests/distributed/test_torchrun.py",
    "tests/test_cpu_allocator.py", "tests/faults/test_rendezvous.py",
)


def unit_of(nodeid: str) -> str:
    """The unit of work ``pytest -n N --dist loadgroup`` (the README's test command) gives one worker
    whole: its module, so that module-scoped fixtures are built once; each docs page alone. Modules
    that start a local Ray cluster or learner ranks may run beside each other on the two workers, as
    they did in every CI run before this scheduler existed (the suite's longest unit stays one module)."""
    module = nodeid.split("::", 1)[0]
    return nodeid if module in PER_TEST else module


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` by ``unit_of`` the test ids. (Not by ``xdist_group`` markers: xdist 3.8 turns
    them into a test-id suffix, which pytest 9.2's test ids no longer take, pytest-xdist#1386; every
    test then went to the workers alone, each worker building every module fixture again.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # units in collection order: LONGEST_FIRST's

    class ByUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return ByUnit(config, log)


def pytest_collection_modifyitems(config, items):
    rank = {module: i for i, module in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable: the rest as collected
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not "gpu" in keywords: a folder named gpu matches that
            item.add_marker(skip_gpu)
