"""The learner's optimizers: one per trainable agent, clipped, stepped and zeroed together.

    optimizers = Optimizers.for_agents(agents, options)     # AdamW (fused) or SGD per trainable agent
    optimizers.init_state()                                 # AdamW moments made before the first forward
    grad_norm = optimizers.step()                           # clip each, step, zero; the largest norm

The ``Learner`` calls ``step()`` after each mini-batch; ``ml.compile`` and the distributed learner
build theirs here (the latter with a clip that reads FSDP2's sharded norms).
(TRL: ``Trainer.create_optimizer`` + ``clip_grad_norm_``; verl: ``actor.optimizer`` in the worker.)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

Clip = Callable[[list[torch.Tensor], float], float]


def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> float:
    """``torch.nn.utils.clip_grad_norm_`` (same norm, same scaled gradients, bit for bit) that
    skips the scaling pass when its coefficient clamps to 1: that pass multiplies every gradient
    by 1.0, a read and a write of all of them (1 GB for a 135M model in fp32) for nothing."""
    total = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    if float(torch.clamp(max_norm / (total + 1e-6), max=1.0)) != 1.0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return float(total)


def init_adamw_state(optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Give each AdamW parameter the state its first ``step()`` would create (step 0, zero
    moments; ``tests/compiler/test_optimizer_step.py`` holds it to torch's own), now. Made before
    the first forward, the moments (twice the trainable weights) lie together, below the step's
    memory, rather than in the holes the first backward left, which the next steps' activations
    and gradients then cannot use whole (SmolLM2 full fine-tuning: 2557 instead of 2608 MiB peak).
    A parameter an earlier optimizer holds is skipped: one Agent bound under two names has two
    optimizers, and only the first steps (its ``zero_grad`` leaves the second no gradients)."""
    seen: set[int] = set()
    for opt in optimizers:
        if not isinstance(opt, torch.optim.Adam):  # AdamW subclasses Adam
            continue
        for group in opt.param_groups:
            on_device = group["fused"] or group["capturable"]
            scalar = torch.float32 if group["fused"] or torch.get_default_dtype() != torch.float64 else torch.float64
            for p in group["params"]:
                state, fresh = opt.state[p], id(p) not in seen
                seen.add(id(p))
                if state or not fresh:
                    continue
                state["step"] = (torch.zeros((), dtype=scalar, device=p.device) if on_device
                                 else torch.tensor(0.0, dtype=scalar))
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if group["amsgrad"]:
                    state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def make_optimizer(agent, options) -> torch.optim.Optimizer:
    """AdamW (or SGD) over the agent's trainable parameters as they are now (FSDP2: this rank's
    shards), at ``value_lr`` for a value head. The parameters keep their dtype (fp32 master
    weights when the agent computes in bf16 under autocast), and so does the optimizer state,
    except under ``optimizer="adamw_8bit"`` (``adamw_8bit``)."""
    params = [p for p in agent.parameters() if p.requires_grad]
    lr = (options.value_lr or options.lr) if getattr(agent, "head", None) == "value" else options.lr
    if options.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=options.weight_decay)
    if options.optimizer == "adamw_8bit":
        return adamw_8bit(params, lr=lr, betas=options.betas, weight_decay=options.weight_decay)
    # fused: one kernel over all tensors (CPU and CUDA); 6x faster than the default
    # per-tensor loop on a 135M model on CPU. Same update rule, float-rounding differences only.
    fused = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.AdamW(params, lr=lr, betas=options.betas, weight_decay=options.weight_decay,
                             fused=fused or None)


def adamw_8bit(params: list[torch.Tensor], *, lr: float, betas: tuple[float, float],
               weight_decay: float) -> torch.optim.Optimizer:
    """torchao's ``AdamW8bit`` (Dettmers et al. 2022, "8-bit Optimizers via Block-wise
    Quantization"; bitsandbytes' ``AdamW8bit``, TRL/verl's ``optim="adamw_8bit"``): both moments
    kept as 8-bit codes with a scale per block of 256 (dynamic-tree quantisation), 2 bytes of
    state a parameter instead of 8; tensors under 4096 elements keep fp32 moments. Its state dict
    saves and loads through ``torch.load(weights_only=True)`` (torchao registers the state class),
    so checkpoints and resumes are those of the default optimizer. On CUDA torchao compiles the
    update (one graph per parameter shape); on a CPU the same update runs eagerly: compiling it
    there needs a C++ toolchain and took 300 s for one shape here."""
    try:
        from torchao.optim import AdamW8bit
        from torchao.optim.adam import single_param_adam
    except ImportError as exc:
        from materl.errors import ConfigError

        raise ConfigError(f"optimizer='adamw_8bit' needs torchao ({exc}); install it with pip install "
                          f"'materl[memory]' or choose optimizer='adamw'") from None

    class MaterlAdamW8bit(AdamW8bit):
        compiled = bool(params) and all(p.device.type == "cuda" for p in params)

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                if not isinstance(group["lr"], torch.Tensor):  # an LR schedule assigned a float
                    group["lr"] = torch.tensor(group["lr"], dtype=torch.float32)
            if self.compiled:
                return super().step(closure)
            for group in self.param_groups:
                for p in (p for p in group["params"] if p.grad is not None):
                    state = self.state[p]
                    if not state:  # as torchao's step makes it
                        state["step"] = torch.tensor(0.0)
                        state["exp_avg"] = self._new_buffer(p, True)
                        state["exp_avg_sq"] = self._new_buffer(p, False)
                    state["step"] += 1
                    single_param_adam(p.detach(), p.grad, state["step"], state["exp_avg"], state["exp_avg_sq"],
                                      None, group["lr"], group["betas"][0], group["betas"][1],
                                      group["weight_decay"], group["eps"], True, False)
            return None

    return MaterlAdamW8bit(params, lr=lr, betas=betas, weight_decay=weight_decay)


class Optimizers:
    """The optimizers of one learner, by agent name (``by_agent``), stepped together."""

    def __init__(self, by_agent: Mapping[str, torch.optim.Optimizer], *, max_grad_norm: float | None,
                 clip: Clip = clip_grad_norm):
        self.by_agent = dict(by_agent)
        self.max_grad_norm = max_grad_norm
        self.clip = clip

    @classmethod
    def for_agents(cls, agents: Mapping[str, Any], options, *, clip: Clip = clip_grad_norm) -> Optimizers:
        return cls({name: make_optimizer(a, options) for name, a in agents.items() if a.trainable},
                   max_grad_norm=options.max_grad_norm, clip=clip)

    def init_state(self) -> None:
        init_adamw_state(list(self.by_agent.values()))

    def step(self) -> float:
        """Clip each optimizer's gradients by their global norm, step, zero; the largest norm."""
        norms = []
        for opt in self.by_agent.values():
            params = [p for g in opt.param_groups for p in g["params"]]
            if self.max_grad_norm is not None:
                norms.append(self.clip(params, self.max_grad_norm))
            opt.step()
            opt.zero_grad(set_to_none=True)
        return max(norms, default=0.0)
