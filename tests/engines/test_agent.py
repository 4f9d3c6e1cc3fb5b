"""Agent: lazy loading, trainable vs frozen, the learner-facing methods, copies and saving."""

import asyncio

import pytest
import torch

from materl.agent import Agent
from materl.engines.base import SamplingParams
from materl.engines.models import load_model, position_ids_from_mask
from materl.engines.sglang_engine import SGLangEngine
from materl.engines.transformers_engine import TransformersEngine
from materl.errors import ConfigError, UnknownNameError

IDS = torch.tensor([[259, 259, 104, 105, 106], [104, 105, 106, 107, 108]])
MASK = (IDS != 259).long()


def test_loads_lazily_and_reprs_short():
    agent = Agent("tiny-random", trainable=True, lora=dict(r=4))
    assert not agent.loaded and agent.name == "tiny-random"
    assert repr(agent) == "Agent('tiny-random', trainable, lora=r4)"
    agent.tokenizer  # noqa: B018 - first use loads model and tokenizer
    assert agent.loaded
    assert repr(Agent("tiny-random", head="value")) == "Agent('tiny-random', head='value')"


def test_bad_arguments_name_the_valid_choices():
    with pytest.raises(UnknownNameError, match="valid: mojo, sglang, transformers"):
        Agent("tiny-random", engine="vllm")
    with pytest.raises(ConfigError, match="head"):
        Agent("tiny-random", head="q")
    with pytest.raises(ConfigError, match="unknown lora option"):
        Agent("tiny-random", lora=dict(rank=2))
    with pytest.raises(ConfigError, match="no value head"):
        Agent("tiny-random").values(IDS, MASK)
    with pytest.raises(ConfigError, match="bad engine_options"):
        Agent("tiny-random", engine_options=dict(max_batchh=2)).engine  # noqa: B018


def test_frozen_vs_trainable_parameters():
    frozen, full = Agent("tiny-random"), Agent("tiny-random", trainable=True)
    lora = Agent("tiny-random", trainable=True, lora=dict(r=4))
    critic = Agent("tiny-random", trainable=True, lora=dict(r=4), head="value")
    assert frozen.parameters() == [] and not frozen.model.training
    n_all = sum(p.numel() for p in full.model.parameters())
    assert sum(p.numel() for p in full.parameters()) == n_all and full.model.training
    # LoRA r=4 on q,k,v,o of 2 layers; q,o: 64->64, k,v: 64->32 (2 kv heads of 16).
    # A is r x in, B is out x r: q,o 4*64 + 64*4 = 512 each; k,v 4*64 + 32*4 = 384 each
    # -> 1792 a layer, 3584 in all
    assert sum(p.numel() for p in lora.parameters()) == 2 * 1792
    names = [n for n, _ in critic.named_parameters()]
    assert "v_head.weight" in names and "v_head.bias" in names and len(names) == 16 + 2


def test_same_name_agents_have_independent_weights():
    a, b = Agent("tiny-random", trainable=True), Agent("tiny-random")
    wa, wb = a.model.lm_head.weight, b.model.lm_head.weight
    assert torch.equal(wa, wb)
    with torch.no_grad():
        wa.add_(1.0)
    assert not torch.equal(wa, wb)


def test_hidden_states_and_output_embedding_give_the_model_logits():
    agent = Agent("tiny-random", trainable=True, lora=dict(r=4))
    with torch.no_grad():  # make the adapters non-trivial so the check covers them
        for n, p in agent.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.5)
    hidden = agent.hidden_states(IDS, MASK)
    weight, bias = agent.output_embedding()
    assert hidden.shape == (2, 5, 64) and weight.shape == (512, 64) and bias is None
    with torch.no_grad():
        ref = agent.model(input_ids=IDS, attention_mask=MASK, position_ids=position_ids_from_mask(MASK)).logits
    assert torch.allclose((hidden @ weight.T)[MASK.bool()], ref[MASK.bool()], atol=1e-5)
    hidden.sum().backward()  # gradients reach the adapters
    assert all(p.grad is not None for p in agent.parameters())


def test_value_head_gradient_float64():
    critic = Agent("tiny-random", head="value", trainable=True, dtype=torch.float64)
    head = critic.model.v_head
    hidden = critic.hidden_states(IDS, MASK).detach()

    def values_of(weight, bias):  # what values() computes on top of the backbone
        return hidden @ weight[0] + bias

    assert torch.allclose(critic.values(IDS, MASK), values_of(head.weight, head.bias), atol=1e-12)
    w = head.weight.detach().clone().requires_grad_(True)
    b = head.bias.detach().clone().requires_grad_(True)
    assert torch.autograd.gradcheck(values_of, (w, b))


def test_state_dict_round_trip_and_copy_shares_nothing():
    policy = Agent("tiny-random", trainable=True)
    with torch.no_grad():
        policy.model.lm_head.weight.mul_(2.0)
    ref = policy.copy()
    assert not ref.trainable and ref.parameters() == [] and ref.model is not policy.model
    assert torch.equal(ref.model.lm_head.weight, policy.model.lm_head.weight)
    with torch.no_grad():
        policy.model.lm_head.weight.zero_()
    assert ref.model.lm_head.weight.abs().sum() > 0
    other = Agent("tiny-random")
    other.load_state_dict(ref.state_dict())
    assert torch.equal(other.model.lm_head.weight, ref.model.lm_head.weight)


def test_save_pretrained_merges_lora(tmp_path):
    agent = Agent("tiny-random", trainable=True, lora=dict(r=4))
    with torch.no_grad():
        for n, p in agent.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.5)
    agent.save_pretrained(tmp_path)
    merged, _ = load_model(tmp_path)
    with torch.no_grad():
        assert torch.allclose(merged(IDS[1:]).logits, agent.model(IDS[1:]).logits, atol=1e-5)
    assert type(agent.model).__name__ == "PeftModelForCausalLM"  # the agent itself stays unmerged


def test_engine_is_made_on_first_use_from_the_registry():
    agent = Agent("tiny-random", engine="transformers", engine_options=dict(max_batch=8))
    assert isinstance(agent.engine, TransformersEngine) and agent.engine.max_batch == 8
    assert agent.engine is agent.engine
    gen = asyncio.run(agent.engine.generate(agent.tokenizer.encode("hi"), SamplingParams(max_new_tokens=4, seed=0)))
    assert len(gen.token_ids) <= 4
    remote = Agent("tiny-random", engine="sglang", engine_options=dict(url="http://sglang:30000"))
    assert isinstance(remote.engine, SGLangEngine) and remote.engine.export_weights == remote.save_pretrained
    assert not remote.loaded  # making the client does not load weights


def test_default_engine_is_mojo_where_it_runs_and_transformers_elsewhere(recwarn):
    from materl.agent import DEFAULT_ENGINE
    from materl.engines.mojo_engine import MojoEngine, mojo_available

    agent = Agent("tiny-random")
    assert DEFAULT_ENGINE == "mojo" and repr(agent) == "Agent('tiny-random')"
    expected = MojoEngine if mojo_available()[0] else TransformersEngine
    assert type(agent.engine) is expected
    assert not [w for w in recwarn if "mojo" in str(w.message)]  # not asked for: no fallback warning


def test_chat_ids_render_the_template_as_ints():
    agent = Agent("tiny-random")
    ids = agent.chat_ids([{"role": "user", "content": "hi"}])
    # byte tokenizer: <|im_start|>=257, "user\nhi" bytes, <|im_end|>=258, "\n", then the prompt
    assert ids == [257, *b"user\nhi", 258, 10, 257, *b"assistant\n"]


def test_agent_from_a_module_needs_a_tokenizer():
    model, tok = load_model("tiny-random")
    agent = Agent(model, tokenizer=tok, name="mine")
    assert agent.model is model and agent.name == "mine" and agent.parameters() == []
    with pytest.raises(ConfigError, match="tokenizer"):
        Agent(model)


@pytest.mark.slow
def test_smollm2_agents_as_in_the_seed_code():
    policy = Agent("smollm2-135m-instruct", trainable=True)
    critic = Agent("smollm2-135m-instruct", head="value", trainable=True)
    tok = policy.tokenizer
    prompt = policy.chat_ids([{"role": "user", "content": "Say hi."}])
    gen = asyncio.run(policy.engine.generate(prompt, SamplingParams(max_new_tokens=8, temperature=0.7, seed=0)))
    assert tok.decode(gen.token_ids, skip_special_tokens=False) == gen.metadata["text"]
    ids = torch.tensor([prompt + gen.token_ids])
    with torch.no_grad():
        logits = policy.hidden_states(ids, torch.ones_like(ids)) @ policy.output_embedding()[0].T
    ref = (logits[0, len(prompt) - 1 : -1] / 0.7).log_softmax(-1).gather(-1, torch.tensor(gen.token_ids)[:, None])
    assert torch.allclose(ref.squeeze(-1), torch.tensor(gen.logprobs), atol=1e-4)
    assert critic.values(ids, torch.ones_like(ids)).shape == ids.shape
