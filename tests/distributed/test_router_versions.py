"""The router (which worker runs which group) and the weight stores (how a version travels),
against hand-worked assignments and real tensors, files and agents."""

import pytest
import torch

import materl as ml
from materl.distributed.router import Router
from materl.distributed.versions import (
    DiskStore,
    InProcessStore,
    load_version,
    version_state,
)
from materl.distributed.errors import RolloutWorkersLostError
from materl.errors import ConfigError


def test_groups_go_whole_to_the_least_loaded_live_worker():
    router = Router(["w0", "w1", "w2"])
    # loads 4, 0, 2 episodes in flight; groups of 2 episodes: w1 (0 -> 2), then w1 (tie 2 with w2, lower index),
    # then w2 (2), then w1 (4, tie with w0 and w2 at 4 -> w0 has the lowest index)
    assert router.assign([0, 1, 2, 3], [4, 0, 2], 2) == {1: [0, 1], 2: [2], 0: [3]}
    router.mark_dead(1)
    # w1 is dead: group 0 to w2 (2 -> 4), group 1 to w0 (tie at 4, lower index); w1's load 0 is ignored
    assert router.assign([0, 1], [4, 0, 2], 2) == {2: [0], 0: [1]}


def test_deterministic_routing_is_group_index_mod_live_workers():
    router = Router(["w0", "w1"], deterministic=True)
    assert router.assign([0, 1, 2, 3, 4], [9, 0], 4) == {0: [0, 2, 4], 1: [1, 3]}  # loads are ignored
    router.mark_dead(0)
    assert router.assign([0, 1, 2], [0, 0], 4) == {1: [0, 1, 2]}


def test_losing_every_worker_is_an_error():
    class Worker:
        def __init__(self, name):
            self.name = name

    router = Router([Worker("rollout-0"), Worker("rollout-1")])
    router.mark_dead(1, "RayActorError: the actor died unexpectedly")
    with pytest.raises(RolloutWorkersLostError, match=r"every rollout worker has died \(2 of 2\), so the run cannot "
                                                      r"sample any more: rollout-0: killed; rollout-1: RayActorError"):
        router.mark_dead(0, "killed")
    assert issubclass(RolloutWorkersLostError, RuntimeError)


@pytest.fixture
def policy():
    return ml.Agent("tiny-random", trainable=True)


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_a_published_version_is_a_snapshot_that_loads_into_another_agent(kind, policy, tmp_path):
    store = InProcessStore() if kind == "memory" else DiskStore(tmp_path / "versions")
    agents = {"policy": policy}
    state = version_state(agents, ["policy"])
    assert set(state) == {f"policy/{n}" for n, p in policy.model.named_parameters() if p.requires_grad}
    store.publish(1, state)
    snapshot = {k: v.clone() for k, v in state.items()}
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(1.0)  # the learner moves on: the published version must not follow
    store.publish(2, version_state(agents, ["policy"]))
    assert store.versions() == [1, 2]
    assert all(torch.equal(store.get(1)[k], v) for k, v in snapshot.items())

    follower = ml.Agent("tiny-random")
    load_version({"policy": follower}, store.get(1), version=1)
    params = dict(follower.model.named_parameters())
    assert all(torch.equal(params[k.split("/", 1)[1]], v) for k, v in snapshot.items())
    assert follower.policy_version == 1

    store.retain([2])
    assert store.versions() == [2]
    with pytest.raises(ConfigError, match="no weights of version 1"):
        store.get(1)


def test_a_version_naming_parameters_the_agent_lacks_is_refused(policy):
    with pytest.raises(ConfigError, match="version 3 names parameters agent 'policy' does not have"):
        load_version({"policy": policy}, {"policy/not.a.parameter": torch.zeros(1)}, version=3)
