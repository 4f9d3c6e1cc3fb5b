"""The asynchronous pipeline (materl.distributed.pipeline) in one process: lock-step equivalence,
the staleness bound, version tags, deterministic re-runs and resumes, partial rollouts."""

import math
import os
import signal
import subprocess
import sys
import time

import anyio
import pytest
import torch
from materl.recipes import grpo

import materl as ml
from materl.compiler.episode import Episode
from materl.distributed.launch import rollout_copy
from materl.distributed.pipeline import Pipeline
from materl.distributed.versions import InProcessStore, version_state
from materl.distributed.workers import Job, LocalWorker
from materl.rollout.env import EnvStep
from materl.runtime.data import Sampler
from materl.runtime.tasks import arithmetic_rows
from materl.runtime.train import train

SAME = ("loss", "reward", "tokens", "grad_norm", "async/batch_version", "async/staleness_max")


def make_step(**options):
    return ml.compile(grpo, policy=ml.Agent("tiny-random", trainable=True), ref_policy=ml.Agent("tiny-random"),
                      group_size=2, max_new_tokens=6, lr=1e-3, seed=0, **options)


def run(tmp_path, name, steps=4, resume=False, **options):
    step = make_step(**options)
    try:
        out = train(step, arithmetic_rows(16, seed=1), steps=steps, batch_size=2, run_dir=tmp_path / name,
                    resume=tmp_path / name if resume else None, progress=False, tensorboard=False)
        return out["history"], [p.detach().clone() for p in step.agents["policy"].parameters()]
    finally:
        step.close()


def test_lock_step_pipeline_is_compiled_run_step_by_step(tmp_path):
    history, weights = run(tmp_path, "pipeline", steps=3)
    loop = make_step()
    sampler = Sampler(arithmetic_rows(16, seed=1), batch_size=2, seed=0, shuffle=True)  # as ml.train draws
    torch.manual_seed(0)
    try:
        by_hand = [loop.run(sampler.next_batch()) for _ in range(3)]
    finally:
        loop.close()
    for h, m in zip(history, by_hand):
        assert [h[k] for k in ("loss", "reward", "tokens", "grad_norm")] == [m[k] for k in ("loss", "reward", "tokens",
                                                                                            "grad_norm")]
        assert h["async/staleness_max"] == 0.0 and h["async/batch_version"] == h["step"] - 1
    for p, q in zip(weights, loop.agents["policy"].parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("S", [1, 2])
def test_deterministic_staleness_is_exactly_the_bound(tmp_path, S):
    """Batch k samples from version max(0, k - S): its tokens are min(k, S) versions old."""
    history, _ = run(tmp_path, f"s{S}", steps=4, max_staleness=S, deterministic=True)
    for k, h in enumerate(history):
        assert h["async/batch_version"] == max(0, k - S)
        assert h["async/staleness_max"] == h["async/staleness_mean"] == min(k, S)
        assert h["async/dropped_stale"] == 0.0 and math.isfinite(h["loss"])


def test_asynchronous_staleness_never_exceeds_the_bound(tmp_path):
    history, _ = run(tmp_path, "free", steps=4, max_staleness=1)
    assert all(h["async/staleness_max"] <= 1 and h["async/dropped_stale"] == 0 for h in history)
    assert all(h["async/batch_version"] >= h["step"] - 2 for h in history)


def test_deterministic_rerun_repeats_every_batch(tmp_path):
    a, wa = run(tmp_path, "a", steps=4, max_staleness=2, deterministic=True)
    b, wb = run(tmp_path, "b", steps=4, max_staleness=2, deterministic=True)
    assert [[h[k] for k in SAME] for h in a] == [[h[k] for k in SAME] for h in b]
    assert all(torch.equal(p, q) for p, q in zip(wa, wb))


def test_deterministic_resume_at_staleness_2_equals_the_uninterrupted_run(tmp_path):
    full, wf = run(tmp_path, "full", steps=6, max_staleness=2, deterministic=True)
    run(tmp_path, "half", steps=3, max_staleness=2, deterministic=True)
    resumed, wr = run(tmp_path, "half", steps=6, resume=True, max_staleness=2, deterministic=True)
    assert [h["step"] for h in resumed] == [4, 5, 6]
    assert [[h[k] for k in SAME] for h in full[3:]] == [[h[k] for k in SAME] for h in resumed]
    assert all(torch.equal(p, q) for p, q in zip(wf, wr))


KILLED_RUN = """
import sys
import materl as ml
from materl.recipes import grpo
from materl.runtime.tasks import arithmetic_rows
from materl.runtime.train import train
step = ml.compile(grpo, policy=ml.Agent("tiny-random", trainable=True), ref_policy=ml.Agent("tiny-random"),
                  group_size=2, max_new_tokens=6, lr=1e-3, seed=0, max_staleness=2, deterministic=True)
train(step, arithmetic_rows(16, seed=1), steps=6, batch_size=2, run_dir=sys.argv[1], save_every=1,
      progress=False, tensorboard=False)
"""


def test_kill_9_mid_run_then_resume_at_staleness_2_equals_the_uninterrupted_run(tmp_path):
    """The run is killed by SIGKILL as soon as step 3's checkpoint is written (batches 4 and 5
    are rolling out on versions 2 and 3 by then); resuming from the folder repeats the rest."""
    full, wf = run(tmp_path, "full", steps=6, max_staleness=2, deterministic=True)
    folder = tmp_path / "killed"
    child = subprocess.Popen([sys.executable, "-c", KILLED_RUN, str(folder)], stderr=subprocess.PIPE, text=True)
    latest = folder / "checkpoints" / "latest"
    deadline = time.monotonic() + 300
    while not (latest.exists() and latest.read_text().strip() == "step-000003"):
        assert child.poll() is None, child.stderr.read()
        assert time.monotonic() < deadline, "the run never wrote step 3's checkpoint"
        time.sleep(0.01)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    resumed, wr = run(tmp_path, "killed", steps=6, resume=True, max_staleness=2, deterministic=True)
    done = int(resumed[0]["step"]) - 1  # the checkpoint resumed from: step 3, or a later one saved before the kill
    assert done >= 3 and [h["step"] for h in resumed] == list(range(done + 1, 7))
    assert [[h[k] for k in SAME] for h in full[done:]] == [[h[k] for k in SAME] for h in resumed]
    assert all(torch.equal(p, q) for p, q in zip(wf, wr))


# ----------------------------------------------------------------------------- workers and versions


class WaitsForNewWeights:
    """Two model turns; between them the environment waits for ``release`` (as a slow tool would)."""

    waiting: anyio.Event
    release: anyio.Event

    def __init__(self):
        self.turn = 0

    async def reset(self, prompt, **columns):
        return prompt

    async def step(self, text):
        self.turn += 1
        if self.turn == 1:
            WaitsForNewWeights.waiting.set()
            await WaitsForNewWeights.release.wait()
            return EnvStep("go on", None, False)
        return EnvStep(None, 1.0, True)

    def is_done(self):
        return self.turn >= 2


def publish_next(step, store, version):
    """The learner moves on: nudge the policy's weights and publish them as ``version``."""
    with torch.no_grad():
        for p in step.agents["policy"].parameters():
            p.add_(0.01)
    store.publish(version, version_state(step.agents, ["policy"]))


@ml.recipe
def two_turns(policy, prompts):
    rollout = ml.env_rollout(policy, WaitsForNewWeights, prompts, max_turns=2, name="rollout")
    ml.set_loss(ml.policy_loss(ml.advantages(ml.reward("step_rewards", rollout=rollout)),
                               ml.logprobs(policy, prompts, rollout)))


@pytest.mark.parametrize("partial, oldest", [(True, None), (False, None), (False, 0)])
def test_partial_rollouts_continue_on_new_weights(partial, oldest):
    """A job for version 1 arrives while an episode of version 0 waits between its turns: with
    ``partial_rollouts`` the worker loads version 1 at once and the episode's second turn is
    sampled (and tagged) with it; without, the new job waits for the old episode to finish, or,
    if the bound lets it use version 0 (``oldest=0``), starts at once on version 0."""
    step = ml.compile(two_turns, policy=ml.Agent("tiny-random", trainable=True), group_size=1, max_new_tokens=4)
    store = InProcessStore()
    store.publish(0, version_state(step.agents, ["policy"]))
    publish_next(step, store, 1)
    copy = rollout_copy(step.agents["policy"], deterministic=False)
    worker = LocalWorker(step.context(), {"policy": copy}, store=store, partial_rollouts=partial)
    order = []

    async def main():
        WaitsForNewWeights.waiting, WaitsForNewWeights.release = anyio.Event(), anyio.Event()
        async with anyio.create_task_group() as tg:
            async def job(version, prompt):
                eps = await worker.run(Job(step=version, rows=[prompt], groups=(0,), version=version,
                                           oldest=oldest if version == 1 else None))
                order.append(version)
                results[version] = eps

            results: dict[int, list[Episode]] = {}
            tg.start_soon(job, 0, "first")
            await WaitsForNewWeights.waiting.wait()  # the first episode's first turn is sampled
            tg.start_soon(job, 1, "second")
            if partial:
                await wait_until(lambda: worker.version == 1)
            if oldest is not None:
                await wait_until(lambda: worker.load == 2)  # both running, on version 0
            WaitsForNewWeights.release.set()
        return results

    try:
        results = step.call_blocking(main)
    finally:
        step.close()
    first = results[0][0].values["rollout"]
    turns = [s.metadata.get("version") for s in first.steps if s.trainable]
    assert turns == ([0, 1] if partial else [0, 0])
    if not partial and oldest is None:
        assert order == [0, 1]  # the version-1 job started only after the version-0 episode ended
    second = results[1][0].values["rollout"]
    assert {s.metadata.get("version") for s in second.steps if s.trainable} == ({0} if oldest == 0 else {1})


@pytest.mark.parametrize("move_to_newest", [True, False])
def test_a_worker_that_must_move_moves_to_the_newest_version(move_to_newest):
    """A job for version 1 (oldest 1) waits for the version-0 episode to finish; meanwhile the
    learner publishes version 2. With ``move_to_newest`` (runs that are not deterministic) the
    worker then loads version 2, so the batches after it can start on it at once; without, it
    loads exactly version 1."""
    step = ml.compile(two_turns, policy=ml.Agent("tiny-random", trainable=True), group_size=1, max_new_tokens=4)
    store = InProcessStore()
    store.publish(0, version_state(step.agents, ["policy"]))
    copy = rollout_copy(step.agents["policy"], deterministic=False)
    worker = LocalWorker(step.context(), {"policy": copy}, store=store, move_to_newest=move_to_newest)

    async def main():
        WaitsForNewWeights.waiting, WaitsForNewWeights.release = anyio.Event(), anyio.Event()
        results: dict[int, list[Episode]] = {}
        async with anyio.create_task_group() as tg:
            async def job(version, prompt):
                results[version] = await worker.run(Job(step=version, rows=[prompt], groups=(0,), version=version,
                                                        oldest=version))

            tg.start_soon(job, 0, "first")
            await WaitsForNewWeights.waiting.wait()
            publish_next(step, store, 1)
            tg.start_soon(job, 1, "second")
            await wait_until(lambda: worker.waiting.get(1) == 1)  # held back: version 0 is still in use
            publish_next(step, store, 2)
            WaitsForNewWeights.release.set()
        return results

    try:
        results = step.call_blocking(main)
    finally:
        step.close()
    second = results[1][0].values["rollout"]
    assert {s.metadata.get("version") for s in second.steps if s.trainable} == ({2} if move_to_newest else {1})
    assert worker.oldest_needed() == worker.version == (2 if move_to_newest else 1)


async def wait_until(condition, passes=10_000):
    for _ in range(passes):
        if condition():
            return
        await anyio.sleep(0.001)
    raise AssertionError("condition never held")


def test_stale_groups_are_dropped_and_counted():
    """The bound holds even if a worker falls behind: a group with a token older than the bound
    is left out of the update (whole group), and counted."""
    step = make_step(max_staleness=1)
    try:
        episodes = step.call_blocking(step.rollout, ["1+1=", "2+2="])
        pipeline = Pipeline(step, [], InProcessStore(), next_batch=lambda j: [], max_staleness=1)
        step.step_count = 3  # the learner is at version 3; these tokens are version 0: 3 versions old
        for ep in episodes[2:]:  # the second group was "resampled" at version 2
            for s in step.episode_rollout(ep).steps:
                s.metadata["version"] = 2
        assert pipeline._drop_stale(episodes) == 2
        assert [ep.filtered for ep in episodes] == [True, True, False, False]
    finally:
        step.close()
