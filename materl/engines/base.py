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
    """Everything ``Agent`` and ``materl.distributed`` use of an engine; nothing outside
    ``engines/`` compares an engine's name.

    ``weights_version``: the policy version of the weights it samples from, recorded in each
    ``Generation.metadata["version"]`` (set by whoever loads new weights).
    ``runs_on_cuda`` (class attribute): whether it can decode a model on a CUDA device (the Mojo
    forward is CPU code). ``deterministic_options`` (class attribute): the engine options under
    which a row's numbers do not depend on which requests share its batch (deterministic
    off-policy mode applies them to rollout copies; ``{}`` where that always holds).
    """

    weights_version: int
    runs_on_cuda: bool
    deterministic_options: dict

    @classmethod
    def for_agent(cls, agent, **options) -> "Engine":
        """The engine for ``agent`` (its model, tokenizer, device and dtypes) with ``options``
        (the agent's ``engine_options``); may return another engine (Mojo falls back)."""
        ...

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation: ...

    def sync_weights(self) -> None:
        """Make the engine sample from the agent's current weights (after a learner step)."""
        ...

    def sleep(self) -> None:
        """The rollout stage is over: free decode-only memory until the next ``generate``
        (verl's rollout ``sleep``/``wake_up`` play this part)."""
        ...

    async def aclose(self) -> None: ...


ENGINES: Registry = Registry("engine")
