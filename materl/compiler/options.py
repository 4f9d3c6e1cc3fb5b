"""Compile options: one typed, validated record; every knob has one default, here."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from materl.errors import ConfigError


@dataclass(frozen=True)
class CompileOptions:
    # rollout
    group_size: int = 4  # episodes per prompt
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_turns: int = 4  # cap on generate steps per episode (env rollouts)
    max_concurrent_episodes: int = 256
    episode_timeout_s: float = 300.0
    tool_timeout_s: float = 30.0  # per tool call, for servers/toolboxes that set no timeout_s of their own
    max_tool_output_tokens: int | None = 2048  # tool output cut to this many tokens (marker added); None: no cap
    system_prompt: str | None = None
    # learner
    lr: float = 1e-6
    optimizer: str = "adamw"  # adamw, sgd
    value_lr: float | None = None  # default: lr
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float | None = 1.0
    epochs: int = 1  # passes over each rollout batch (PPO epochs)
    mini_batch_size: int | None = None  # rows per optimizer step (default: the whole batch)
    micro_batch_size: int | None = None  # rows per forward/backward (default: the mini-batch)
    shuffle: bool = False  # shuffle rows between epochs (seeded)
    logprob_chunk_size: int = 1024  # rows of the (tokens x vocab) matrix held at once
    share_prompts: bool = True  # rows with the same prompt run it once in the learner forward
    advantage: str | None = None  # default advantage estimator (else the recipe's, else grpo)
    reference: str = "frozen"  # reference-model policy: none, frozen, ema, periodic, adaptive
    reference_options: tuple[tuple[str, Any], ...] = ()
    seed: int = 0
    # implementation choices
    kernels: str = "auto"  # auto (Mojo where available), torch, mojo
    cuda_graphs: bool = False

    _ranges = {
        "group_size": (1, None), "max_new_tokens": (1, None), "temperature": (0.0, None),
        "top_p": (0.0, 1.0), "top_k": (0, None), "max_turns": (1, None),
        "max_concurrent_episodes": (1, None), "episode_timeout_s": (0.0, None), "tool_timeout_s": (0.0, None),
        "max_tool_output_tokens": (1, None),
        "lr": (0.0, None), "weight_decay": (0.0, None), "epochs": (1, None), "mini_batch_size": (1, None),
        "micro_batch_size": (1, None), "logprob_chunk_size": (1, None), "max_grad_norm": (0.0, None),
    }

    def __post_init__(self):
        for name, (lo, hi) in self._ranges.items():
            v = getattr(self, name)
            if v is None:
                continue
            if not isinstance(v, (int, float)) or isinstance(v, bool) or (lo is not None and v < lo) or (
                hi is not None and v > hi
            ):
                rng = f"[{lo}, {'inf' if hi is None else hi}]"
                raise ConfigError(f"compile option {name}={v!r} is out of range; accepted: {rng}")
        if self.optimizer not in ("adamw", "sgd"):
            raise ConfigError(f"compile option optimizer={self.optimizer!r}; accepted: adamw, sgd")
        if self.kernels not in ("auto", "torch", "mojo"):
            raise ConfigError(f"compile option kernels={self.kernels!r}; accepted: auto, torch, mojo")

    @classmethod
    def from_kwargs(cls, **kw: Any) -> CompileOptions:
        known = {f.name for f in fields(cls) if not f.name.startswith("_")}
        unknown = sorted(set(kw) - known)
        if unknown:
            import difflib

            hints = [f"{u!r} (did you mean {difflib.get_close_matches(u, known, 1)[0]!r}?)"
                     if difflib.get_close_matches(u, known, 1) else repr(u) for u in unknown]
            raise ConfigError(f"unknown compile option(s) {', '.join(hints)}; options: {', '.join(sorted(known))}")
        if isinstance(kw.get("reference_options"), dict):
            kw["reference_options"] = tuple(sorted(kw["reference_options"].items()))
        if isinstance(kw.get("betas"), list):
            kw["betas"] = tuple(kw["betas"])
        return cls(**kw)
