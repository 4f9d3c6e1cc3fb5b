"""The optimizer step: gradient clipping equals torch's clip_grad_norm_ bit for bit, and AdamW state
made ahead of the first step equals the state torch makes lazily."""

import math

import pytest
import torch

from materl.compiler.compiled import clip_grad_norm, init_adamw_state


def _params(scale: float) -> list[torch.Tensor]:
    torch.manual_seed(0)
    params = [torch.zeros(5, 3, requires_grad=True), torch.zeros(7, requires_grad=True),
              torch.zeros(2, requires_grad=True)]
    for p in params:
        p.grad = torch.randn(p.shape) * scale
    params[2].grad = None  # a parameter that got no gradient this step
    return params


@pytest.mark.parametrize("scale", [1e-3, 10.0, float("nan")])
def test_clip_matches_torch_bit_for_bit(scale):
    ours, theirs = _params(scale), _params(scale)
    if math.isnan(scale):  # one NaN gradient: torch scales every gradient by a NaN coefficient
        ours[0].grad[0, 0] = theirs[0].grad[0, 0] = float("nan")
    norm = clip_grad_norm(ours, 1.0)
    expected = float(torch.nn.utils.clip_grad_norm_(theirs, 1.0))
    assert (math.isnan(norm) and math.isnan(expected)) or norm == expected
    for a, b in zip(ours, theirs):
        assert (a.grad is None) == (b.grad is None)
        if a.grad is not None:
            assert torch.equal(a.grad.nan_to_num(7.0), b.grad.nan_to_num(7.0))


def test_small_gradients_are_left_untouched_and_large_ones_scaled_to_max_norm():
    small = _params(1e-3)
    before = [p.grad.clone() for p in small[:2]]
    clip_grad_norm(small, 1.0)
    assert all(torch.equal(p.grad, b) for p, b in zip(small[:2], before))
    large = _params(10.0)
    norm = clip_grad_norm(large, 1.0)
    assert norm > 1.0
    after = torch.cat([p.grad.flatten() for p in large[:2]]).norm()
    assert after == pytest.approx(1.0, rel=1e-5)  # max_norm / (norm + 1e-6) * norm


def _adamw_pair(**kw) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.optim.AdamW, torch.optim.AdamW]:
    torch.manual_seed(0)
    shapes = [(6, 4), (5,), (3, 2, 2)]
    lazy = [torch.randn(s, requires_grad=True) for s in shapes]
    eager = [p.detach().clone().requires_grad_() for p in lazy]
    return lazy, eager, torch.optim.AdamW(lazy, lr=1e-2, weight_decay=0.1, **kw), \
        torch.optim.AdamW(eager, lr=1e-2, weight_decay=0.1, **kw)


@pytest.mark.parametrize("kw", [{"fused": True}, {"foreach": True}, {"foreach": False},
                                {"fused": True, "amsgrad": True}, {"foreach": False, "amsgrad": True}],
                         ids=["fused", "foreach", "for-loop", "fused-amsgrad", "amsgrad"])
def test_adamw_state_made_ahead_steps_as_torch_lazy_state_bit_for_bit(kw):
    lazy, eager, lazy_opt, eager_opt = _adamw_pair(**kw)
    init_adamw_state([eager_opt])
    assert all(float(eager_opt.state[p]["exp_avg"].abs().sum()) == 0.0 for p in eager)
    for step in range(3):
        grads = [torch.randn(p.shape, generator=torch.Generator().manual_seed(step * 10 + i))
                 for i, p in enumerate(lazy)]
        for ps, opt in ((lazy, lazy_opt), (eager, eager_opt)):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            opt.step()
    for a, b in zip(lazy, eager):
        assert torch.equal(a, b)
        sa, sb = lazy_opt.state[a], eager_opt.state[b]
        assert sa.keys() == sb.keys()
        for k in sa:
            assert (sa[k].dtype, sa[k].device, sa[k].shape) == (sb[k].dtype, sb[k].device, sb[k].shape), k
            assert torch.equal(sa[k], sb[k]), k


def test_adamw_state_skips_parameters_an_earlier_optimizer_holds_and_existing_state():
    _, params, _, first = _adamw_pair(fused=True)
    second = torch.optim.AdamW(params, lr=1e-2, fused=True)  # one Agent bound under two names
    init_adamw_state([first, second])
    assert all(first.state[p] for p in params) and not any(second.state.get(p) for p in params)
    first.state[params[0]]["exp_avg"].fill_(5.0)
    init_adamw_state([first])  # a restored or stepped state is left as it is
    assert float(first.state[params[0]]["exp_avg"][0, 0]) == 5.0
    sgd = torch.optim.SGD(params, lr=0.1)
    init_adamw_state([sgd])
    assert not any(sgd.state.get(p) for p in params)
