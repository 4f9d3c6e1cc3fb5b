"""A 2-rank learner step equals the 1-process full-batch step of ``ml.compile``.

Two real gloo processes (torch.multiprocessing.spawn) learn on the batches the one-process run
learned on: 7 rows then 8, mini-batches of 4 (the 3-row one splits 2/1, so rank 1 pads with a
weight-0 micro-step), micro-batches of 1, completions of 1..12 tokens (so a rank's share of the
tokens is not its share of the rows: only global denominators make the ranks' gradients add up
to the full batch's). Float64 on tiny-random; both sides use HF's float32 rotary cos/sin alike,
so they agree to float64 summation order (~1e-16 here).

Both strategies run their configurations in one spawned pair of processes (a module fixture), to
pay the process start-up once: SGD without clipping (the update is -lr * gradient, so the
gradient itself is compared), AdamW with clipping active (the global norm of sharded
gradients), two epochs with shuffling, LoRA adapters, and an EMA reference (updated on every
rank from the whole policy). Each configuration also resumes: a fresh learner loads the state
saved after step 1 and its step 2 must be the uninterrupted run's, bit for bit.
"""

import pickle

import pytest
import torch
import torch.multiprocessing as mp

from materl.compiler.packing import MicroBatching
from materl.distributed.learner import RankPartition
from materl.distributed.torchrun import free_port
from tests.distributed import helpers as H
from tests.tolerance import assert_same_update

CONFIGS = {"ddp": ["full-sgd", "lora-adamw", "tis-adamw", "packed-lora-ckpt"],
           "fsdp2": ["full-sgd", "lora-adamw", "full-adamw-ema", "tis-adamw", "packed-lora-ckpt"]}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict:
    """Every configuration of both strategies, learned by one spawned pair of gloo ranks (the
    process start-up paid once), against the shared one-process references."""
    out = tmp_path_factory.mktemp("ranks")
    cases = {}
    for strategy, names in CONFIGS.items():
        for name in names:
            ref = H.case(name)
            cases[strategy, name] = {"name": f"{strategy}-{name}", "strategy": strategy, "lora": H.CASES[name][1],
                                     "batches": ref["batches"], "ref": ref, "options": H.CASES[name][0]}
    configs = [{k: v for k, v in c.items() if k not in ("ref", "options")} for c in cases.values()]
    mp.spawn(H.run_configs, args=(2, free_port(), configs, str(out)), nprocs=2)
    for c in cases.values():
        c["ranks"] = [torch.load(out / f"{c['name']}-rank{r}.pt", weights_only=False) for r in (0, 1)]
    return cases


def check(case: dict) -> None:
    ref, (rank0, rank1) = case["ref"], case["ranks"]
    assert [v for v, _, _ in rank0["results"]] == [1, 2]
    assert all(w is None for _, _, w in rank1["results"])  # only rank 0 holds the published weights
    for k, (version, metrics, weights) in enumerate(rank0["results"]):
        before, expected = ref["weights"][k], ref["weights"][k + 1]
        assert weights.version == version and sorted(weights.tensors) == ["policy"]
        got = weights.tensors["policy"]
        assert sorted(got) == sorted(expected)  # the trainable parameters (LoRA: adapters only)
        assert_same_update([got[n] for n in expected], list(expected.values()), list(before.values()))
        if case["options"].get("optimizer") == "sgd":  # after = before - lr * gradient
            lr = case["options"]["lr"]
            for n in expected:
                grad, expected_grad = (before[n] - got[n]) / lr, (before[n] - expected[n]) / lr
                atol = 1e-6 * max(1.0, float(expected_grad.abs().max()))
                torch.testing.assert_close(grad, expected_grad, rtol=0, atol=atol,
                                           msg=lambda m, n=n: f"gradient of {n}: {m}")
        want = ref["metrics"][k]
        assert metrics["loss"] == pytest.approx(want["loss"], rel=1e-9, abs=1e-12)
        assert metrics["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-9, abs=1e-12)
        if case["options"].get("max_grad_norm"):
            assert metrics["grad_norm"] > case["options"]["max_grad_norm"]  # so clipping did act
        if case["options"].get("max_tokens_per_micro_batch") is None:  # else ranks cut other micro-batches,
            # and the entropy metric is a mean of per-micro-batch means (the loss and gradients are exact)
            assert metrics["entropy"] == pytest.approx(want["entropy"], rel=1e-9)
        # the engine-vs-learner mismatch: over every rank's rows (gathered), or the recomputed
        # proximal log-probs' over the whole batch (TIS)
        mismatch = sorted(k for k in want if k.startswith("mismatch/"))
        assert mismatch and sorted(k for k in metrics if k.startswith("mismatch/")) == mismatch
        for k in mismatch:
            assert metrics[k] == pytest.approx(want[k], rel=1e-9, abs=1e-12), k
        if "correction" in case["options"]:  # TIS weights pi_proximal/pi_sampling, averaged as in one process
            for k in ("policy_loss/is_weight", "policy_loss/is_truncated"):
                assert metrics[k] == pytest.approx(want[k], rel=1e-9, abs=1e-12), k
    own0, own1 = rank0["own"], rank1["own"]
    assert all(torch.equal(own0[n], own1[n]) for n in own0)  # every rank applied the identical update
    # resumed from the state after step 1 (models, optimizer states, a following reference), a
    # fresh learner's step 2 is the uninterrupted run's
    state, resumed, uninterrupted = rank0["state"], rank0["resumed"], rank0["results"][1][2]
    follows = case["options"].get("reference") == "ema"
    assert state.version == 1 and sorted(state.models) == (["policy", "ref_policy"] if follows else ["policy"])
    assert resumed.version == 2 and rank1["resumed"] is None
    for n, value in uninterrupted.tensors["policy"].items():
        assert torch.equal(resumed.tensors["policy"][n], value), n


@pytest.mark.parametrize("name", CONFIGS["ddp"])
def test_two_ddp_ranks_equal_one_process(ranks, name):
    check(ranks["ddp", name])


@pytest.mark.parametrize("name", CONFIGS["fsdp2"])
def test_two_fsdp2_ranks_equal_one_process(ranks, name):
    check(ranks["fsdp2", name])


def test_the_batch_travels_whole():
    """What the ranks receive is the pickled (episodes, StepContext) of the one-process run."""
    ref = H.case("full-sgd")
    episodes, ctx = pickle.loads(ref["batches"][0])
    assert len(episodes) == 8 and sum(e.ok for e in episodes) == 7 and ctx.options.micro_batch_size == 1
    lengths = [len(e.values["completions"].completion_ids) for e in episodes]
    assert len(set(lengths)) > 2  # uneven token counts across rows


def test_rows_split_contiguously_with_weight_zero_padding():
    rows = torch.tensor([6, 2, 5, 0, 3, 1, 4])  # a shuffled mini-batch of 7 rows
    one, two = MicroBatching(rows=1), MicroBatching(rows=2)
    parts = [RankPartition(None, "ddp", r, 2).micro_batches(rows, two) for r in (0, 1)]
    # rank 0: rows 6 2 5 0 (two micro-batches); rank 1: 3 1 4 (two, the second of one row)
    assert [(m.tolist(), w) for m, w in parts[0]] == [([6, 2], 1.0), ([5, 0], 1.0)]
    assert [(m.tolist(), w) for m, w in parts[1]] == [([3, 1], 1.0), ([4], 1.0)]
    # 3 rows over 2 ranks in micro-batches of 2: rank 1 has one row and rank 0 two, one step each
    assert [(m.tolist(), w) for m, w in RankPartition(None, "ddp", 1, 2).micro_batches(rows[:3], two)] == [([5], 1.0)]
    # 1 row over 2 ranks: rank 1 has none and runs one weight-0 step on the batch's first row
    assert [(m.tolist(), w) for m, w in RankPartition(None, "ddp", 1, 2).micro_batches(rows[:1], one)] == [([6], 0.0)]
    # micro-batches of 1: rank 0 has 4 steps, rank 1 three rows plus one weight-0 step
    assert [w for _, w in RankPartition(None, "ddp", 1, 2).micro_batches(rows, one)] == [1.0, 1.0, 1.0, 0.0]
