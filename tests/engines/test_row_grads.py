"""Row gradients for a trained input embedding (``materl.engines.hf.token_inputs``): the same
gradient as the dense lookup, tied or not, accumulated over micro-batches, and a dense
``param.grad``; the plain lookup where no gradient is taken."""

import copy

import pytest
import torch
from materl.recipes import grpo
from transformers import LlamaForCausalLM

import materl as ml
from materl.engines import hf
from materl.engines.models import load_model
from materl.engines.value_head import ValueHeadModel
from tests.tolerance import assert_close_to_scale, assert_same_update


def _llama(dtype=torch.float64, tied: bool = True):
    """tiny-random's shape, by default with the LM head tied to the input embedding (as SmolLM2's is)."""
    base, tok = load_model("tiny-random")
    config = copy.deepcopy(base.config)
    config.tie_word_embeddings = tied
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(dtype)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    return model, tok


# Two prompts (one repeats a token, one holds the padding id 259), three rows continuing them.
PREFIX = torch.tensor([[104, 105, 104, 106], [259, 107, 108, 0]])
PREFIX_MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
OWNER = torch.tensor([0, 0, 1])
SUFFIX = torch.tensor([[110, 104, 111], [112, 113, 0], [104, 259, 114]])
SUFFIX_MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]])


def _loss(model, hidden):
    """A log-likelihood through the tied LM head, so both uses of the weight get gradients."""
    logp = torch.log_softmax(hidden @ model.lm_head.weight.T, dim=-1)
    return -(logp[..., 104] + 0.5 * logp[..., 259]).sum()


def _plain_lookup(lm, ids):
    """``token_inputs`` as it was before row gradients: the decoder embeds the ids itself."""
    return {"input_ids": ids}


def _grads(model, shared: bool, rows: bool, monkeypatch, micro_batches: int = 1):
    if not rows:
        monkeypatch.setattr(hf, "token_inputs", _plain_lookup)
    model.zero_grad(set_to_none=True)
    for _ in range(micro_batches):  # gradient accumulation: the rows add into the kept gradient
        if shared:
            last, suffix = hf.shared_prefix_hidden_states(model, PREFIX, PREFIX_MASK, OWNER, SUFFIX, SUFFIX_MASK)
            hidden = torch.cat([last[:, None], suffix], dim=1)
        else:
            ids = torch.cat([PREFIX[OWNER], SUFFIX], dim=1)
            hidden = hf.backbone_hidden_states(model, ids, torch.cat([PREFIX_MASK[OWNER], SUFFIX_MASK], dim=1))
        _loss(model, hidden).backward()
    monkeypatch.undo()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("shared", [False, True], ids=["full-rows", "shared-prompts"])
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_row_gradients_equal_the_dense_lookups_and_stay_dense(shared, tied, micro_batches, monkeypatch):
    model, _ = _llama(tied=tied)
    rows = _grads(model, shared, True, monkeypatch, micro_batches)
    dense = _grads(model, shared, False, monkeypatch, micro_batches)
    assert rows.keys() == dense.keys()
    for name in dense:
        assert rows[name].layout == torch.strided, name
        assert_close_to_scale(rows[name], dense[name], rel=1e-12, msg=name)
    emb = rows["model.embed_tokens.weight"]
    assert emb[104].abs().max() > 0  # a looked-up row
    if tied:
        assert emb[300].abs().max() > 0  # a row only the LM head reads
    else:  # the padding id (looked up, but nn.Embedding's padding_idx gets no gradient) and an unread row
        assert emb[259].abs().max() == 0 and emb[300].abs().max() == 0


def test_plain_lookup_where_no_embedding_gradient_is_taken():
    model, _ = _llama(torch.float32)
    ids = PREFIX[:1]
    assert set(hf.token_inputs(model, ids)) == {"inputs_embeds"}
    with torch.no_grad():
        assert set(hf.token_inputs(model, ids)) == {"input_ids"}
    model.requires_grad_(False)  # frozen (a reference model, a LoRA policy's base)
    assert set(hf.token_inputs(model, ids)) == {"input_ids"}


def test_a_value_head_on_a_tied_backbone_gets_a_dense_gradient():
    model, _ = _llama(torch.float32)
    critic = ValueHeadModel.wrap(model)  # what head="value" loads
    ids = torch.cat([PREFIX[OWNER], SUFFIX], dim=1)
    critic(ids, torch.ones_like(ids)).sum().backward()
    grad = hf.causal_lm_of(critic.backbone).get_input_embeddings().weight.grad
    assert grad is not None and grad.layout == torch.strided and grad.abs().max() > 0


def test_a_grpo_step_on_a_tied_policy_matches_the_dense_lookup(monkeypatch):
    model, tok = _llama(torch.float32)
    before = [p.detach().clone() for p in model.parameters()]

    def step(row_grads: bool):
        policy = ml.Agent(copy.deepcopy(model), trainable=True, tokenizer=tok, engine="transformers")
        if not row_grads:
            monkeypatch.setattr(hf, "token_inputs", _plain_lookup)
        compiled = ml.compile(grpo, policy=policy, ref_policy=ml.Agent(copy.deepcopy(model), tokenizer=tok,
                                                                       engine="transformers"),
                              group_size=4, max_new_tokens=5, lr=1e-3, seed=2,
                              temperature=0.2)  # repeated completions in a group: rewards differ, so the update is not 0
        metrics = compiled.run(prompts=["ab", "cd"])
        monkeypatch.undo()
        return [p.detach().clone() for p in policy.model.parameters()], metrics

    (rows, m_rows), (dense, m_dense) = step(True), step(False)
    assert m_rows["tokens"] == m_dense["tokens"] > 0
    assert_same_update(rows, dense, before, rel=1e-5)
