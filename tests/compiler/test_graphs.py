"""``cuda_graphs=True``: static (bucketed) learner shapes and the captured-forward code path.

On a CPU the capture itself cannot run, so ``compile(..., cuda_graphs=True)`` is refused with a
``CompileError``; the same code path without capture (static shapes, the graphed forward run as a
plain function) must give the eager learner's numbers. GPU tests (``-m gpu``) capture for real.
"""

from __future__ import annotations

import pytest
import torch

import materl as ml
from materl.compiler import graphs
from materl.compiler.sequences import bucket, build_seq_batch
from materl.errors import CompileError
from materl.recipes import grpo
from materl.rollout.types import Rollout, Step
from tests.tolerance import assert_same_update


def test_bucket_rounds_up_to_powers_of_two_from_16():
    assert [bucket(n) for n in (1, 15, 16, 17, 31, 33, 100, 128, 129)] == [16, 16, 16, 32, 32, 64, 128, 128, 256]
    assert bucket(3, minimum=1) == 4
    with pytest.raises(ValueError, match="size >= 1, got 0"):
        bucket(0)


def test_padded_rows_keep_their_values_and_slice_to_buckets():
    agent = ml.Agent("tiny-random")
    rollouts = [Rollout(prompt_ids=[5, 6, 7], steps=[Step("generate", [8, 9], [-0.5, -0.25])]),
                Rollout(prompt_ids=[5], steps=[Step("generate", [10], [-1.0])])]
    sb = build_seq_batch(agent.tokenizer, [None, None], rollouts)
    assert sb.input_ids.shape == (2, 5) and sb.width == 2
    static = sb.padded(bucket(5), bucket(2))
    assert static.input_ids.shape == (2, 16) and static.width == 16 and static.static
    assert torch.equal(static.input_ids[:, :5], sb.input_ids) and not static.attention_mask[:, 5:].any()
    assert torch.equal(static.old_logprobs[:, :2], sb.old_logprobs) and not static.mask[:, 2:].any()
    rows = static.rows(torch.tensor([1]))  # length 2 -> its bucket, 16 (never the unpadded 2)
    assert rows.input_ids.shape == (1, 16) and rows.static
    assert sb.rows(torch.tensor([1])).input_ids.shape == (1, 2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without CUDA does")
def test_cuda_graphs_without_cuda_is_a_compile_error():
    policy, ref = ml.Agent("tiny-random", trainable=True), ml.Agent("tiny-random")
    with pytest.raises(CompileError, match="cuda_graphs=True needs CUDA: torch .* sees no CUDA device"):
        ml.compile(grpo, policy=policy, ref_policy=ref, cuda_graphs=True)


def _one_step(monkeypatch, *, cuda_graphs: bool):
    # seed 2: its groups' rewards differ (with seed 3 they are equal under the engines'
    # counter-based draws, and an all-zero update would compare nothing)
    if cuda_graphs:  # the capture needs CUDA; this runs the same path with capture=False
        monkeypatch.setattr(graphs, "check", lambda agents: None)
    policy, ref = ml.Agent("tiny-random", trainable=True), ml.Agent("tiny-random")
    before = [p.detach().clone() for p in policy.parameters()]
    step = ml.compile(grpo, policy=policy, ref_policy=ref, group_size=4, max_new_tokens=8, lr=1.0, seed=2,
                      optimizer="sgd", kernels="torch", micro_batch_size=4, cuda_graphs=cuda_graphs)
    metrics = step.run(["one", "two", "three"])
    step.close()
    return metrics, before, [p.detach().clone() for p in policy.parameters()]


def test_static_graphed_path_without_capture_equals_eager(monkeypatch):
    """Same rollouts (same seeds), the update once on dynamic shapes with shared prompts and once
    on bucketed static shapes through the graphed forward (not captured on a CPU): right padding
    that no trained token reads, so the loss and the SGD update agree to float32 rounding."""
    eager, before, after_eager = _one_step(monkeypatch, cuda_graphs=False)
    static, before2, after_static = _one_step(monkeypatch, cuda_graphs=True)
    for a, b in zip(before, before2):
        assert torch.equal(a, b)
    assert static["reward"] == eager["reward"]  # the rollout stage is untouched
    assert abs(static["loss"] - eager["loss"]) <= 1e-6 * max(1.0, abs(eager["loss"]))
    assert abs(static["grad_norm"] - eager["grad_norm"]) <= 1e-5 * eager["grad_norm"]
    assert_same_update(after_static, after_eager, before)


def test_graphed_forward_records_one_shape_per_bucket():
    calls = []
    fn = graphs.GraphedForward(lambda x: calls.append(x.shape) or x * 2, capture=False)
    for n in (16, 16, 32):
        assert torch.equal(fn(torch.ones(2, n)), torch.full((2, n), 2.0))
    assert fn.shapes == {((2, 16),), ((2, 32),)} and len(calls) == 3


@pytest.mark.gpu
def test_captured_learner_step_equals_eager_on_cuda():
    """On CUDA: the captured graphs replayed give the eager step's update (fp32 compute, so only
    kernel-choice rounding differs)."""
    results = []
    for cuda_graphs in (False, True):
        policy = ml.Agent("tiny-random", trainable=True, device="cuda", compute_dtype="float32")
        ref = ml.Agent("tiny-random", device="cuda", compute_dtype="float32")
        before = [p.detach().clone() for p in policy.parameters()]
        step = ml.compile(grpo, policy=policy, ref_policy=ref, group_size=4, max_new_tokens=8, lr=1.0, seed=2,
                          optimizer="sgd", kernels="torch", micro_batch_size=4, cuda_graphs=cuda_graphs)
        metrics = step.run(["one", "two", "three"])
        step.run(["four", "five", "six"])  # a second step replays the graphs captured in the first
        step.close()
        results.append((metrics, before, [p.detach().clone() for p in policy.parameters()]))
    (eager, before, after_eager), (graphed, _, after_graphed) = results
    assert abs(graphed["loss"] - eager["loss"]) <= 1e-4 * max(1.0, abs(eager["loss"]))
    assert_same_update(after_graphed, after_eager, before, rel=1e-4, margin=10.0)


def test_cuda_graph_thread_fills_the_storage_torch_2_11_asserts_on():
    """torch 2.11's ``cudagraph_trees.get_obj`` asserts that a thread other than the importer has
    the tree managers in its thread-local storage (the bare AssertionError every captured decode
    hit on an H200, in materl's compute thread). That lookup, as 2.11 wrote it, fails in a fresh
    thread and works there after ``cuda_graph_thread()``."""
    import threading

    from torch._inductor import cudagraph_trees as trees

    from materl.device import cuda_graph_thread

    def get_obj_2_11(local, name):
        if hasattr(local, name):
            return getattr(local, name)
        assert torch._C._is_key_in_tls(name)
        return torch._C._get_obj_in_tls(name)

    seen = {}

    def fresh_thread():
        try:
            get_obj_2_11(trees.local, "tree_manager_containers")
            seen["before"] = "found"
        except AssertionError:
            seen["before"] = "AssertionError"
        cuda_graph_thread()
        seen["after"] = type(get_obj_2_11(trees.local, "tree_manager_containers")).__name__
        seen["locks"] = type(get_obj_2_11(trees.local, "tree_manager_locks")).__name__

    t = threading.Thread(target=fresh_thread)
    t.start()
    t.join()
    assert seen == {"before": "AssertionError", "after": "dict", "locks": "defaultdict"}
