import pytest
import torch

from materl.errors import ConfigError, ShapeError, UnknownNameError
from materl.ops.reference import (
    REFERENCE_POLICIES,
    AdaptiveReset,
    EMAReference,
    copy_params_,
    ema_params_,
    frozen_copy,
    make_reference_policy,
)


def _params(*values):
    return [torch.tensor(v, dtype=torch.float64) for v in values]


def test_registry_names_and_uses_reference():
    assert REFERENCE_POLICIES.names() == ["adaptive", "ema", "frozen", "none", "periodic"]
    assert make_reference_policy("none").uses_reference is False
    for name in ("frozen", "ema", "periodic", "adaptive"):
        assert make_reference_policy(name).uses_reference is True


def test_unknown_name_and_hyperparameter_list_choices():
    valid = "valid: adaptive, ema, frozen, none, periodic"
    with pytest.raises(UnknownNameError, match=f"unknown reference_policy 'emaa'; {valid}"):
        make_reference_policy("emaa")
    accepted = r"accepted: \['decay', 'every'\]"
    with pytest.raises(ConfigError, match=r"'ema' got unknown hyperparameter\(s\) \['alpha'\]; " + accepted):
        make_reference_policy("ema", alpha=0.5)
    with pytest.raises(ConfigError, match="0 <= decay <= 1, got decay=1.5"):
        EMAReference(decay=1.5)
    with pytest.raises(ConfigError, match="every >= 1"):
        make_reference_policy("periodic", every=0)


def test_none_and_frozen_never_change_the_reference():
    for name in ("none", "frozen"):
        ref, pol = _params([1.0, 2.0]), _params([5.0, 6.0])
        assert make_reference_policy(name).update(ref, pol, step=1, kl=10.0) is False
        assert ref[0].tolist() == [1.0, 2.0]


def test_ema_hand_computed():
    # decay 0.75: ref = 0.75*ref + 0.25*pol. Step 1: 0.75*4 + 0.25*8 = 5; step 2: 0.75*5 + 0.25*8 = 5.75.
    # Second tensor: 0.75*0 + 0.25*(-4) = -1, then 0.75*(-1) + 0.25*(-4) = -1.75.
    ref, pol = _params([4.0], [0.0]), _params([8.0], [-4.0])
    ema = make_reference_policy("ema", decay=0.75)
    assert ema.update(ref, pol, step=1) is True
    assert [r.item() for r in ref] == [5.0, -1.0]
    assert ema.update(iter(ref), iter(pol), step=2) is True  # any iterable, e.g. model.parameters()
    assert [r.item() for r in ref] == [5.75, -1.75]


def test_ema_every_follows_trl_sync_steps():
    # TRL fires when global_step % ref_model_sync_steps == 0, with alpha = 1 - decay = 0.5:
    # steps 1, 2 do nothing; step 3: 0.5*0 + 0.5*2 = 1; steps 4, 5 nothing; step 6: 0.5*1 + 0.5*2 = 1.5.
    ref, pol = _params([0.0]), _params([2.0])
    ema = EMAReference(decay=0.5, every=3)
    changed = [ema.update(ref, pol, step=s) for s in range(1, 7)]
    assert changed == [False, False, True, False, False, True]
    assert ref[0].item() == 1.5


def test_ema_matches_trl_sync_target_model():
    # TRL SyncRefModelCallback._sync_target_model: target.mul_(1 - alpha).add_(copy, alpha=alpha)
    g = torch.Generator().manual_seed(0)
    pol = [torch.randn(3, 4, generator=g, dtype=torch.float64), torch.randn(5, generator=g, dtype=torch.float64)]
    ref = [torch.randn(3, 4, generator=g, dtype=torch.float64), torch.randn(5, generator=g, dtype=torch.float64)]
    trl_ref = [r.clone() for r in ref]
    alpha = 0.6
    for target, copy in zip(trl_ref, pol):
        target.mul_(1.0 - alpha).add_(copy, alpha=alpha)
    ema_params_(ref, pol, decay=1 - alpha)
    for a, b in zip(ref, trl_ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_periodic_hard_reset_every_n():
    ref, pol = _params([1.0]), _params([1.0])
    periodic = make_reference_policy("periodic", every=2)
    seen = []
    for step in range(1, 6):
        pol[0] += 1.0  # policy after step s holds 1 + s
        periodic.update(ref, pol, step=step)
        seen.append(ref[0].item())
    # reset at steps 2 and 4 to the policy's 3 and 5; steps 1, 3, 5 keep the previous value
    assert seen == [1.0, 3.0, 3.0, 5.0, 5.0]


def test_adaptive_resets_exactly_when_accumulated_kl_crosses():
    ref, pol = _params([0.0]), _params([1.0])
    adaptive = AdaptiveReset(kl_threshold=0.5)
    # accumulated (binary-exact): 0.25, 0.375, 0.5 (== threshold: not past it), 0.75 > 0.5 -> reset
    for step, kl in [(1, 0.25), (2, 0.125), (3, 0.125)]:
        assert adaptive.update(ref, pol, step=step, kl=kl) is False
        assert ref[0].item() == 0.0
    assert adaptive.accumulated_kl == 0.5
    assert adaptive.update(ref, pol, step=4, kl=0.25) is True
    assert ref[0].item() == 1.0 and adaptive.accumulated_kl == 0.0
    # after the reset it counts from zero again: 0.3 stays, 0.3 + 0.3 = 0.6 resets; a 0-d tensor kl works
    pol[0].fill_(7.0)
    assert adaptive.update(ref, pol, step=5, kl=torch.tensor(0.3)) is False
    assert adaptive.update(ref, pol, step=6, kl=0.3) is True
    assert ref[0].item() == 7.0
    # a negative (k1) estimate lowers the sum
    adaptive.update(ref, pol, step=7, kl=0.4)
    adaptive.update(ref, pol, step=8, kl=-0.3)
    assert adaptive.accumulated_kl == pytest.approx(0.1)


def test_adaptive_needs_a_finite_kl_and_steps_start_at_one():
    adaptive = make_reference_policy("adaptive", kl_threshold=1.0)
    with pytest.raises(ConfigError, match="needs kl= at every update"):
        adaptive.update(_params([0.0]), _params([1.0]), step=1)
    with pytest.raises(ConfigError, match="non-finite kl=nan"):
        adaptive.update(_params([0.0]), _params([1.0]), step=1, kl=float("nan"))
    with pytest.raises(ConfigError, match="from 1.*got 0"):
        make_reference_policy("periodic").update(_params([0.0]), _params([1.0]), step=0)


def test_parameter_mismatch_is_a_shape_error():
    with pytest.raises(ShapeError, match="reference has 1 parameter tensors but the policy has 2"):
        copy_params_(_params([0.0]), _params([0.0], [1.0]))
    with pytest.raises(ShapeError, match=r"parameter 0: reference shape \[2\] != policy shape \[3\]"):
        ema_params_(_params([0.0, 1.0]), _params([0.0, 1.0, 2.0]), decay=0.5)


def test_frozen_copy_and_updates_on_real_modules():
    policy = torch.nn.Linear(3, 2).double()
    ref = frozen_copy(policy)
    assert not ref.training and all(not p.requires_grad for p in ref.parameters())
    assert all(p.requires_grad for p in policy.parameters())  # the policy is untouched
    with torch.no_grad():
        policy.weight.add_(1.0)
    assert torch.equal(ref.weight, policy.weight - 1.0)  # a copy, not a view
    make_reference_policy("periodic", every=1).update(ref.parameters(), policy.parameters(), step=1)
    assert torch.equal(ref.weight, policy.weight) and torch.equal(ref.bias, policy.bias)
    assert not ref.weight.requires_grad
