"""LearnerBatch: the rollout-to-learner hand-off, built once and sliced per micro-batch."""

import torch

from materl.compiler.batch import LearnerBatch, take
from materl.compiler.episode import Episode, RolloutBatch, collate, to_tensor
from materl.compiler.spec import Kind
from materl.compiler.sequences import build_seq_batch
from materl.engines.tiny import byte_tokenizer
from materl.rollout.types import Rollout, Step


def _episodes():
    eps = []
    for i, (adv, score) in enumerate([([0.5, -1.0, 2.0], 1.0), ([0.25], 0.0), ([1.0, 1.0], 3.0)]):
        ep = Episode(i, i // 2, i // 2, "p", {}, seed=i)
        ep.store("adv", torch.tensor(adv))
        ep.store("score", score)
        ep.store("roll", Rollout(prompt_ids=[5, 6], steps=[Step("generate", [7] * len(adv), [-0.5] * len(adv))]))
        eps.append(ep)
    return eps


def test_sequences_are_built_once_and_columns_slice_like_a_subset_collation():
    eps = _episodes()
    batch = LearnerBatch(eps, device=torch.device("cpu"))
    builds = []

    def build():
        builds.append(1)
        return build_seq_batch(byte_tokenizer(), [None] * 3, [e.values["roll"] for e in eps])

    sb = batch.sequences(("p", "roll"), build)
    assert batch.sequences(("p", "roll"), build) is sb and len(builds) == 1
    assert batch.width == 3 and batch.group_ids.tolist() == [0, 0, 1]
    idx = torch.tensor([2, 0])
    # what the learner gathered per micro-step before: collate the rows' values, pad to the width
    expected = to_tensor(collate([eps[i].resolve("adv") for i in idx.tolist()], Kind.TOKENS), width=3)
    assert torch.equal(batch.rows("adv", Kind.TOKENS, idx), expected)  # [[1, 1, 0], [0.5, -1, 2]]
    assert torch.equal(batch.rows("score", Kind.SCORE, idx), torch.tensor([3.0, 1.0]))
    assert batch.column("adv", Kind.TOKENS) is batch.column("adv", Kind.TOKENS)  # collated once
    rolls = batch.rows("roll", Kind.ROLLOUT, idx)
    assert isinstance(rolls, RolloutBatch) and rolls[0] is eps[2].values["roll"]


def test_put_rows_then_stacked_reads_what_the_update_produced():
    eps = _episodes()
    batch = LearnerBatch(eps, device=torch.device("cpu"))
    batch.sequences(("p", "roll"), lambda: build_seq_batch(byte_tokenizer(), [None] * 3, [e.values["roll"] for e in eps]))
    batch.put_rows("prox", torch.tensor([1, 2]), torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]]))
    assert torch.equal(batch.stacked("prox", torch.tensor([2])), torch.tensor([[0.4, 0.5, 0.6]]))
    assert torch.equal(eps[1].values["prox"], torch.tensor([0.1, 0.2, 0.3]))  # as prepare would store it
    assert take([10, 20, 30], torch.tensor([2, 0])) == [30, 10]
