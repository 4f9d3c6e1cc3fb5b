"""The engine contract. An engine turns prompt token ids into sampled token ids plus the
log-probs of exactly those tokens: log softmax(logits / temperature)[token], without top-p/top-k
renormalisation, which is what the learner recomputes. Engines never re-tokenize: ids in, ids out.

Concurrent ``generate`` calls are allowed and expected; an engine coalesces whatever requests
are pending into batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from materl.registry import Registry


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    stop_token_ids: tuple[int, ...] = ()  # besides the tokenizer's eos ids
    stop_strings: tuple[str, ...] = ()  # generation stops once the decoded text contains one
    greedy: bool = False
    seed: int | None = None


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float]  # one per token id: log softmax(logits / temperature)[token]
    finish_reason: str  # "stop" (eos/stop token), "stop_string", "length"
    prompt_len: int = 0
    metadata: dict = field(default_factory=dict)  # "version": the weights version that sampled it


@runtime_checkable
class Engine(Protocol):
    """``weights_version``: the policy version of the weights it samples from, recorded in each
    ``Generation.metadata["version"]`` (set by whoever loads new weights)."""

    weights_version: int

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation: ...

    def sync_weights(self) -> None:
        """Make the engine sample from the agent's current weights (after a learner step)."""
        ...

    async def aclose(self) -> None: ...


def engine_sleep(engine) -> None:
    """Tell an engine the rollout stage is over: it may free decode-only memory (optional method
    ``sleep``; verl's rollout ``sleep``/``wake_up`` play this part)."""
    sleep = getattr(engine, "sleep", None)
    if callable(sleep):
        sleep()


ENGINES: Registry = Registry("engine")
