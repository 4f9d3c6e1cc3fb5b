"""optimizer="adamw_8bit": torchao's AdamW8bit (8-bit block-wise moments), an AdamW update to the
quantisation's precision, a quarter of the state, and checkpoints that resume bit for bit."""

import pytest
import torch

import materl as ml
from materl.compiler.compiled import Compiled
from materl.compiler.optimizers import adamw_8bit
from materl.compiler.options import CompileOptions
from materl.runtime.checkpoint import load_checkpoint, restore, save_checkpoint

pytest.importorskip("torchao")


def _state_bytes(opt) -> int:
    out = 0
    for state in opt.state.values():
        for k in ("exp_avg", "exp_avg_sq"):
            v = state[k]
            parts = [v.codes, v.scale, v.qmap] if hasattr(v, "codes") else [v]
            out += sum(t.numel() * t.element_size() for t in parts)
    return out


def test_three_steps_follow_adamw_to_the_quantisation_and_keep_a_quarter_of_the_state():
    torch.manual_seed(0)
    w0 = torch.randn(64, 128)  # 8192 elements: 8-bit (torchao quantises tensors of >= 4096 in blocks of 256)
    grads = [torch.randn(64, 128) for _ in range(3)]
    params = {name: torch.nn.Parameter(w0.clone()) for name in ("fp32", "8bit")}
    opts = {"fp32": torch.optim.AdamW([params["fp32"]], lr=1e-2, weight_decay=0.1),
            "8bit": adamw_8bit([params["8bit"]], lr=1e-2, betas=(0.9, 0.999), weight_decay=0.1)}
    for g in grads:
        for name, opt in opts.items():
            params[name].grad = g.clone()
            opt.step()
    exact, quantised = (params["fp32"] - w0).detach(), (params["8bit"] - w0).detach()
    # each step moves a weight by ~lr (Adam's m/sqrt(v) ~ +-1): 3 steps ~1.7e-2 on average. The 8-bit
    # moments carry a relative error of ~1% (256 levels, dynamic-tree map, a scale per block of
    # 256), so the updates agree to ~1% of a step on average (measured: 1e-4, median 0.5% of each
    # element's update), up to ~13% of one step where v is tiny (sqrt(v) magnifies its error)
    err = (quantised - exact).abs()
    assert float(exact.abs().mean()) > 1e-2  # the comparison is not between two tiny numbers
    assert float(err.mean()) < 0.02 * 1e-2 and float(err.max()) < 0.2 * 1e-2
    assert float((err / exact.abs()).median()) < 0.02
    assert float((quantised.sign() == exact.sign()).float().mean()) > 0.99
    state = opts["8bit"].state[params["8bit"]]
    assert state["exp_avg"].codes.dtype == torch.uint8 and state["exp_avg"].codes.numel() == w0.numel()
    # 8 bytes a parameter for fp32 moments; 2 bytes + a 4-byte scale per 256 + the 256-entry map
    assert _state_bytes(opts["fp32"]) == 8 * w0.numel()
    assert _state_bytes(opts["8bit"]) == 2 * w0.numel() + 2 * 4 * (w0.numel() // 256) + 2 * 256 * 4


def _compiled(agent_seed: int = 0) -> Compiled:
    torch.manual_seed(agent_seed)
    from tests.compiler.test_packing import _pg_with

    agents = {"policy": ml.Agent("tiny-random", trainable=True), "ref_policy": ml.Agent("tiny-random")}
    return Compiled(_pg_with("token_mean"), agents, CompileOptions(group_size=2, max_new_tokens=6, lr=1e-2,
                                                                    optimizer="adamw_8bit", seed=0))


def test_a_checkpoint_resumes_the_8bit_state_bit_for_bit(tmp_path):
    a = _compiled()
    try:
        batches = [a.call_blocking(a.rollout, ["Say hi.", "Count."]) for _ in range(2)]
        a.call_blocking(a.learn, batches[0])
        opt = a.optimizers["policy"]
        assert any(hasattr(s["exp_avg"], "codes") for s in opt.state.values())  # 8-bit moments exist
        path = save_checkpoint(tmp_path, 1, agents=a.agents, optimizers=a.optimizers)
        a.call_blocking(a.learn, batches[1])
        uninterrupted = {n: p.detach().clone() for n, p in a.agents["policy"].model.named_parameters()}
    finally:
        a.close()
    b = _compiled()
    try:
        restore(load_checkpoint(path), agents=b.agents, optimizers=b.optimizers)
        b.call_blocking(b.learn, batches[1])
        resumed = {n: p.detach() for n, p in b.agents["policy"].model.named_parameters()}
    finally:
        b.close()
    for n, p in uninterrupted.items():
        assert torch.equal(resumed[n], p), n
    moved = max(float((uninterrupted[n] - p).abs().max()) for n, p in resumed.items())
    assert moved == 0.0
