"""Device placement, checked on a CPU build with a fake accelerator (tests/fake_device.py): the
tiny agent's model on "fakegpu:0", the learner's forward and policy loss and the engine's token
inputs run in a ``FakeTensorMode`` that raises wherever a CPU tensor meets a device one, so any
tensor materl makes without ``device=`` fails these tests. Plus the device/dtype choices
(``materl.device``) and a ``DeviceError`` that names both devices."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import materl as ml
from materl.compiler.sequences import build_seq_batch, completion_hidden
from materl.device import autocast, compute_dtype, on_device, resolve_device
from materl.engines.hf import causal_lm_of, token_inputs
from materl.errors import ConfigError, DeviceError
from materl.ops.kl import kl_penalty
from materl.ops.logprobs import token_logprobs
from materl.ops.losses import POLICY_LOSSES
from tests.fake_device import fake, fake_device, fake_module

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without CUDA does")


@pytest.fixture
def fake_agent():
    """(mode, agent): the tiny agent with its weights on the fake accelerator."""
    mode = FakeTensorMode()  # real (non-fake) tensors inside the mode are errors too
    agent = ml.Agent("tiny-random", trainable=True, engine="transformers", device="cpu")
    with torch.no_grad():
        fake_module(mode, agent.model)
    return mode, agent


def _fake_rows(mode, agent):
    """A SeqBatch of two rows with distinct prompts, every tensor on the fake device."""
    sb = build_seq_batch(agent.tokenizer, ["hi", "hello there"], ["abc", "de"])
    return dataclasses.replace(sb, **{f.name: fake(mode, getattr(sb, f.name))
                                      for f in dataclasses.fields(sb) if f.name != "static"})


def test_fake_agent_reports_its_device(fake_agent):
    _, agent = fake_agent
    assert agent.device == fake_device()


def test_learner_forward_and_policy_loss_stay_on_the_agents_device(fake_agent):
    mode, agent = fake_agent
    sb = _fake_rows(mode, agent)
    with mode, torch.no_grad():
        hidden = completion_hidden(agent, sb, share_prompts=False)
        weight, bias = agent.output_embedding()
        logp = token_logprobs(hidden, weight, sb.completion_ids, bias=bias, temperature=1.0, chunk_size=4)
        adv = torch.ones(2, sb.width, device=sb.device)  # what a CUDA batch's advantages are
        per_token, _ = POLICY_LOSSES.get("ppo_clip")(logp, sb.old_logprobs, adv, sb.mask)
        kl = kl_penalty(logp, sb.old_logprobs, estimator="k3")
        # (the aggregation's zero-denominator check reads a value: a fake tensor has none)
    dev = fake_device()
    assert hidden.device == dev and hidden.shape == (2, sb.width, 64)
    assert logp.device == dev and logp.shape == (2, sb.width)
    assert per_token.device == dev and per_token.shape == (2, sb.width) and kl.device == dev


def test_a_cpu_batch_fed_to_a_cuda_model_is_an_error_naming_both_devices(fake_agent):
    mode, agent = fake_agent
    sb = build_seq_batch(agent.tokenizer, ["hi"], ["abc"])  # left on the CPU: the reported failure
    lm = causal_lm_of(agent.model)
    with mode, torch.no_grad(), pytest.raises(DeviceError, match=r"token ids is on cpu but the model it feeds is on fakegpu:0"):
        token_inputs(lm, sb.input_ids)


def test_engine_token_inputs_on_the_models_device(fake_agent):
    mode, agent = fake_agent
    lm = causal_lm_of(agent.model)
    with mode, torch.no_grad():
        ids = torch.zeros(2, 3, dtype=torch.long, device=fake_device())
        inputs = token_inputs(lm, ids)
        out = lm(**inputs, attention_mask=torch.ones(2, 3, dtype=torch.long, device=fake_device()), use_cache=False)
    assert out.logits.device == fake_device() and out.logits.shape == (2, 3, 512)


def test_device_defaults_and_choices():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(None) == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert compute_dtype(torch.device("cpu"), None) == torch.float32  # CPU numbers unchanged
    assert compute_dtype(torch.device("cuda"), None) == torch.bfloat16
    assert compute_dtype(torch.device("cuda"), "float32") == torch.float32
    with pytest.raises(ConfigError, match="unknown dtype 'fp8'; valid: float32, bfloat16, float16"):
        compute_dtype(torch.device("cpu"), "fp8")
    with pytest.raises(DeviceError, match="not a torch device"):
        resolve_device("gpu0")
    t = torch.ones(2)
    assert on_device(t, like=torch.device("cpu")) is t  # no copy when it is there already


@needs_no_cuda
def test_cuda_asked_for_without_cuda_is_a_clear_error():
    with pytest.raises(DeviceError, match="sees no CUDA device; use device='cpu' or None"):
        ml.Agent("tiny-random", device="cuda")


def test_bf16_autocast_over_fp32_weights_keeps_fp32_master_weights():
    # autocast(cpu, bf16): the matmul computes in bf16, the weight stays fp32 (the master copy)
    w = torch.randn(4, 3)
    x = torch.randn(2, 3)
    with autocast(torch.device("cpu"), torch.bfloat16):
        y = x @ w.T
    assert y.dtype == torch.bfloat16 and w.dtype == torch.float32
    torch.testing.assert_close(y.float(), (x.bfloat16().float() @ w.bfloat16().float().T), atol=0.05, rtol=0.02)
    with autocast(torch.device("cpu"), torch.float32):
        assert (x @ w.T).dtype == torch.float32


def test_agent_engine_default_and_mojo_on_cuda_refused():
    from materl.agent import DEFAULT_ENGINE, default_engine

    assert default_engine(torch.device("cpu")) == DEFAULT_ENGINE
    assert default_engine(torch.device("cuda")) == "transformers"  # the Mojo forward is CPU code
    if torch.cuda.is_available():
        with pytest.raises(ConfigError, match="engine='mojo' runs on the CPU only"):
            ml.Agent("tiny-random", engine="mojo", device="cuda")


def test_learner_batch_lives_on_the_policy_device_and_is_collated_once(tiny):
    from materl.compiler.learner import learner_device

    policy, ref = tiny(trainable=True, device="cpu"), tiny(device="cpu")
    assert learner_device({"ref_policy": ref, "policy": policy}) == torch.device("cpu")


def test_config_and_cli_carry_device_and_dtype(tmp_path):
    from materl.cli import build_parser
    from materl.runtime.config import load_config

    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("model: {name: tiny-random}\n")
    args = build_parser().parse_args(["train", str(cfg_file), "--device", "cpu", "--dtype", "bfloat16",
                                      "--set", "train.steps=1"])
    assert args.overrides == ["model.device=cpu", "model.dtype=bfloat16", "train.steps=1"]
    cfg = load_config(cfg_file, args.overrides)
    assert (cfg.model.device, cfg.model.dtype) == ("cpu", "bfloat16")
    assert build_parser().parse_args(["train", str(cfg_file)]).overrides == []  # the default list is not shared
    with pytest.raises(ConfigError, match="model.device"):
        load_config(cfg_file, ["model.device=gpu0"])
    with pytest.raises(ConfigError, match="model.dtype"):
        load_config(cfg_file, ["model.dtype=fp8"])


@pytest.mark.gpu
def test_grpo_step_on_cuda_in_bf16_keeps_fp32_master_weights(tiny):
    from materl.recipes import grpo

    policy, ref = tiny(trainable=True), tiny()  # device=None: cuda here
    step = ml.compile(grpo, policy=policy, ref_policy=ref, group_size=4, max_new_tokens=8, lr=1e-3)
    metrics = step.run(["one", "two"])
    step.close()
    assert policy.device.type == "cuda" and policy.compute_dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in policy.parameters())
    state = step.optimizers["policy"].state
    assert state and all(s["exp_avg"].dtype == torch.float32 and s["exp_avg"].device.type == "cuda"
                         for s in state.values())
    assert torch.isfinite(torch.tensor(metrics["loss"])) and metrics["mismatch/mean_abs"] < 0.1


@pytest.mark.gpu
def test_checkpoint_written_on_cuda_resumes_on_cpu_and_back(tmp_path, tiny):
    from materl.recipes import grpo
    from materl.runtime.checkpoint import restore, save_checkpoint

    gpu, ref = tiny(trainable=True, device="cuda"), tiny(device="cuda")
    step = ml.compile(grpo, policy=gpu, ref_policy=ref, group_size=2, max_new_tokens=4, lr=1e-3)
    step.run(["one"])
    step.close()
    ckpt = save_checkpoint(tmp_path, 1, agents={"policy": gpu}, optimizers=step.optimizers)
    cpu, ref_cpu = tiny(trainable=True, device="cpu"), tiny(device="cpu")
    cpu_step = ml.compile(grpo, policy=cpu, ref_policy=ref_cpu, group_size=2, max_new_tokens=4, lr=1e-3)
    restore(ckpt, agents={"policy": cpu}, optimizers=cpu_step.optimizers, rng=False)
    for p, q in zip(cpu.parameters(), gpu.parameters()):
        assert p.device.type == "cpu" and torch.equal(p, q.cpu())
    back = tiny(trainable=True, device="cuda")
    restore(save_checkpoint(tmp_path / "cpu", 1, agents={"policy": cpu}, optimizers={}), agents={"policy": back}, rng=False)
    for p, q in zip(back.parameters(), cpu.parameters()):
        assert p.device.type == "cuda" and torch.equal(p.cpu(), q)


@pytest.mark.skipif(importlib.util.find_spec("mojo") is None, reason="needs the mojo engine (bf16 decoding on "
                    "this CPU's oneDNN fails; the Mojo engine samples in fp32 whatever the learner computes in)")
def test_grpo_step_with_a_bf16_learner_over_fp32_weights():
    """compute_dtype="bfloat16": the learner's forward and backward run under bf16 autocast over
    fp32 master weights (what CUDA does by default). The same episodes (the Mojo engine samples
    them identically) give the fp32 step's loss and gradient norm to bf16 precision, and the
    weights stay fp32. This path failed on its first GPU run (the fused SwiGLU backward mixed a
    bf16 gradient with the fp32 weight); no CPU test had run the learner under autocast."""
    from materl.recipes import grpo

    out = {}
    for dtype in ("float32", "bfloat16"):
        policy = ml.Agent("tiny-random", trainable=True, device="cpu", compute_dtype=dtype, engine="mojo")
        c = ml.compile(grpo, policy=policy, ref_policy=policy, group_size=2, max_new_tokens=8, seed=0,
                       kernels="torch")
        out[dtype] = c.run(["hi there", "what is 2+2"])
        c.close()
        assert all(p.dtype == torch.float32 for p in policy.model.parameters())
    fp32, bf16 = out["float32"], out["bfloat16"]
    assert fp32["grad_norm"] > 0 and abs(bf16["grad_norm"] - fp32["grad_norm"]) <= 0.05 * fp32["grad_norm"]
    assert abs(bf16["loss"] - fp32["loss"]) <= 0.05 * max(abs(fp32["loss"]), 1e-3)
