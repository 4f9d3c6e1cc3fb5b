"""Reference-model policies: when, and how, the reference model follows the policy.

Each policy is a small class, hyperparameters in ``__init__``, one call per optimizer step::

    ref = make_reference_policy("ema", decay=0.99)
    ...after optimizer.step():
    changed = ref.update(ref_model.parameters(), policy.parameters(), step=global_step, kl=kl_mean)

``update`` works in place on matching iterables of tensors and returns True when the reference
changed. ``step`` counts completed optimizer steps from 1 (TRL's ``state.global_step`` in
``on_step_end``). ``uses_reference`` is False only for ``none`` (the learner then skips the
reference forward); ``follows`` is False for ``none`` and ``frozen`` (nothing to update after a
step). Built-ins: none, frozen, ema, periodic, adaptive.

Also the primitives they are made of: :func:`frozen_copy` (make a reference from a policy),
:func:`copy_params_` (hard reset) and :func:`ema_params_` (Polyak average).
"""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Iterable
from typing import Protocol

import torch
from torch import Tensor

from materl.errors import ConfigError, ShapeError
from materl.registry import Registry


class ReferencePolicy(Protocol):
    uses_reference: bool
    follows: bool  # False: ``update`` never changes the reference (the learner skips calling it)

    def update(
        self, ref_params: Iterable[Tensor], policy_params: Iterable[Tensor], *, step: int, kl: float | None = None
    ) -> bool: ...


REFERENCE_POLICIES: Registry[type] = Registry("reference_policy")


def make_reference_policy(name: str, **hparams) -> ReferencePolicy:
    """Build the registered policy ``name`` with its hyperparameters; unknown names and
    unknown hyperparameters are errors that list the valid choices."""
    cls = REFERENCE_POLICIES.get(name)
    accepted = [p for p in inspect.signature(cls).parameters]
    unknown = sorted(set(hparams) - set(accepted))
    if unknown:
        raise ConfigError(
            f"reference_policy {name!r} got unknown hyperparameter(s) {unknown}; accepted: {accepted or '(none)'}"
        )
    return cls(**hparams)


# ---------------------------------------------------------------------------------- primitives


def frozen_copy(policy: torch.nn.Module) -> torch.nn.Module:
    """A reference model: a deep copy of ``policy`` in eval mode with ``requires_grad=False``.

    TRL: ``trl.models.create_reference_model`` (without its shared-layers option).
    """
    ref = copy.deepcopy(policy).eval()
    for param in ref.parameters():
        param.requires_grad_(False)
    return ref


def _pairs(ref_params: Iterable[Tensor], policy_params: Iterable[Tensor]) -> list[tuple[Tensor, Tensor]]:
    refs, pols = list(ref_params), list(policy_params)
    if len(refs) != len(pols):
        raise ShapeError(f"reference has {len(refs)} parameter tensors but the policy has {len(pols)}")
    for i, (r, p) in enumerate(zip(refs, pols)):
        if r.shape != p.shape:
            raise ShapeError(f"parameter {i}: reference shape {list(r.shape)} != policy shape {list(p.shape)}")
    return list(zip(refs, pols))


@torch.no_grad()
def copy_params_(ref_params: Iterable[Tensor], policy_params: Iterable[Tensor]) -> None:
    """Hard reset, in place: ``ref <- policy`` for each pair of tensors (casting to ref's dtype
    and device). TRL: ``SyncRefModelCallback`` with ``ref_model_mixup_alpha=1``."""
    for ref, pol in _pairs(ref_params, policy_params):
        ref.copy_(pol)


@torch.no_grad()
def ema_params_(ref_params: Iterable[Tensor], policy_params: Iterable[Tensor], *, decay: float) -> None:
    """Polyak average, in place: ``ref <- decay * ref + (1 - decay) * policy``.

    TRL: ``SyncRefModelCallback._sync_target_model`` with ``alpha = 1 - decay``
    (``ref.mul_(1 - alpha).add_(policy, alpha=alpha)``; TR-DPO, Gorbatovski et al. 2024,
    arXiv:2404.09656).
    """
    for ref, pol in _pairs(ref_params, policy_params):
        ref.mul_(decay).add_(pol.to(device=ref.device, dtype=ref.dtype), alpha=1 - decay)


def _check_step(step: int) -> None:
    if not isinstance(step, int) or step < 1:
        raise ConfigError(f"step counts completed optimizer steps from 1 (TRL's global_step), got {step!r}")


# ---------------------------------------------------------------------------------- policies


@REFERENCE_POLICIES.register("none")
class NoReference:
    """No reference model: KL terms are dropped and the reference forward is skipped."""

    uses_reference = False
    follows = False

    def update(self, ref_params, policy_params, *, step: int, kl: float | None = None) -> bool:
        return False

    def __repr__(self) -> str:
        return "NoReference()"


@REFERENCE_POLICIES.register("frozen")
class FrozenReference:
    """The reference stays the initial policy (TRL and verl default)."""

    uses_reference = True
    follows = False

    def update(self, ref_params, policy_params, *, step: int, kl: float | None = None) -> bool:
        _check_step(step)
        return False

    def __repr__(self) -> str:
        return "FrozenReference()"


@REFERENCE_POLICIES.register("ema")
class EMAReference:
    """Every ``every`` steps, ``ref <- decay * ref + (1 - decay) * policy`` (TR-DPO soft update).

    TRL: ``sync_ref_model=True`` with ``ref_model_mixup_alpha = 1 - decay`` and
    ``ref_model_sync_steps = every`` (``SyncRefModelCallback``: fires when
    ``global_step % every == 0``). TRL's defaults are ``EMAReference(decay=0.4, every=512)``;
    ours (``decay=0.999, every=1``) are those of the materl primitives seed.
    """

    uses_reference = True
    follows = True

    def __init__(self, *, decay: float = 0.999, every: int = 1):
        if not 0.0 <= decay <= 1.0:
            raise ConfigError(f"ema reference needs 0 <= decay <= 1, got decay={decay!r}")
        if not isinstance(every, int) or every < 1:
            raise ConfigError(f"ema reference needs every >= 1 (steps), got every={every!r}")
        self.decay, self.every = decay, every

    def update(self, ref_params, policy_params, *, step: int, kl: float | None = None) -> bool:
        _check_step(step)
        if step % self.every:
            return False
        ema_params_(ref_params, policy_params, decay=self.decay)
        return True

    def __repr__(self) -> str:
        return f"EMAReference(decay={self.decay}, every={self.every})"


@REFERENCE_POLICIES.register("periodic")
class PeriodicReset:
    """Every ``every`` steps, ``ref <- policy`` (hard reset; TR-DPO hard update, or
    ``EMAReference(decay=0, every=every)``). TRL: ``ref_model_mixup_alpha=1``."""

    uses_reference = True
    follows = True

    def __init__(self, *, every: int = 20):
        if not isinstance(every, int) or every < 1:
            raise ConfigError(f"periodic reference needs every >= 1 (steps), got every={every!r}")
        self.every = every

    def update(self, ref_params, policy_params, *, step: int, kl: float | None = None) -> bool:
        _check_step(step)
        if step % self.every:
            return False
        copy_params_(ref_params, policy_params)
        return True

    def __repr__(self) -> str:
        return f"PeriodicReset(every={self.every})"


@REFERENCE_POLICIES.register("adaptive")
class AdaptiveReset:
    """Accumulate the per-step KL(policy || ref); when the sum passes ``kl_threshold``
    (strictly greater), hard-reset ``ref <- policy`` and restart the sum at 0.

    ``kl`` is whatever the learner measures each step (e.g. the masked mean of the k1 or k3
    estimator); it is added as given, so negative k1 estimates lower the sum. No TRL/verl
    counterpart.
    """

    uses_reference = True
    follows = True

    def __init__(self, *, kl_threshold: float = 0.5):
        if not kl_threshold > 0:
            raise ConfigError(f"adaptive reference needs kl_threshold > 0, got {kl_threshold!r}")
        self.kl_threshold = kl_threshold
        self.accumulated_kl = 0.0

    def update(self, ref_params, policy_params, *, step: int, kl: float | None = None) -> bool:
        _check_step(step)
        if kl is None:
            raise ConfigError(f"adaptive reference needs kl= at every update (step {step}), got None")
        kl = float(kl)
        if not math.isfinite(kl):
            raise ConfigError(f"adaptive reference got a non-finite kl={kl} at step {step}")
        self.accumulated_kl += kl
        if self.accumulated_kl <= self.kl_threshold:
            return False
        copy_params_(ref_params, policy_params)
        self.accumulated_kl = 0.0
        return True

    def __repr__(self) -> str:
        return f"AdaptiveReset(kl_threshold={self.kl_threshold}, accumulated_kl={self.accumulated_kl})"
