"""In-process generation over an HF causal LM, with request coalescing.

    engine = TransformersEngine(model, tokenizer, max_batch=64)
    gen = await engine.generate(prompt_ids, SamplingParams(max_new_tokens=32, seed=1))

Batch formation. The first ``await generate(...)`` leads a batch: it yields to the event loop
until a full pass of the loop's ready tasks adds no request (every episode that can reach
``generate`` now has done so; the others are waiting on tools), then decodes everything pending
(up to ``max_batch`` rows) as ONE batch. Requests that arrive during a decode form the next
batch. Nothing here reads a clock, so the same requests arriving in the same order form the same
batches on an idle or a busy machine. (``batch_window_s > 0`` additionally waits that long for
stragglers, e.g. tool results arriving close together: larger batches, but membership then
depends on timing.) The decode runs in materl's compute thread (``materl.compute``: the same
thread as the learner, so torch keeps one OpenMP pool) and the event loop keeps running tool
calls and other episodes meanwhile.

Reproducibility. A run is bit-identical when its batches are: per-row sampling draws from a
counter-based generator keyed by the request's seed and the token's index, but a row's
arithmetic is NOT independent of its batch on torch's CPU kernels (oneDNN picks a different GEMM kernel by row count; left padding changes attention's
reduction length; measured on SmolLM2: |delta log-prob| up to 2e-5, tokens equal). So rollouts
whose requests arrive in an order fixed by the program (single-turn generation, in-process tools
and environments) reproduce exactly under any machine load; with tool servers whose answers can
arrive in a different order, batches can differ and the last bits of the sampling log-probs with
them. The Mojo engine computes each row independently of its batch.

The decode loop is written here rather than calling ``model.generate``: left padding with
positions ``cumsum(mask) - 1``, a ``DynamicCache`` that appends in place (``kv_cache.py``),
identical prompts (a GRPO group) prefilled once, per-row stop rules (eos ids,
``stop_token_ids``, stop strings on the decoded tail, ``max_new_tokens``), finished rows dropped
from the batch and cache, and per-row sampling with uniforms keyed by each request's seed and
token index (``sampling.counter_uniforms``) so a seeded request samples the same tokens whatever
shares its batch. HF ``generate`` has one global generator and one set of sampling settings per
call, which is why it is not used.

The device loop (``device_loop=True``, the default for Llama/Qwen2 models on CUDA;
``device_loop.py``) replaces this loop: sampling and stop checks inside a captured step,
continuous batching, and each episode's KV cache kept across its turns. Its batches are not
coalesced once but re-formed every ``read_every`` steps.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import anyio
import torch
from torch import Tensor

from materl import compute
from materl.device import autocast, compute_dtype
from materl.engines.arrivals import Arrivals, Request, finish
from materl.engines import device_forward
from materl.engines.base import ENGINES, Generation, SamplingParams
from materl.engines.device_loop import DeviceLoop, LoopOptions
from materl.engines.decode_weights import DecodeWeights
from materl.engines.kv_cache import decode_cache
from materl.engines.hf import cache_kwargs, causal_lm_of
from materl.engines.static_decode import StaticDecoder, left_pad as _left_pad
from materl.engines.sampling import (  # noqa: F401  (sample_tokens, top_k_top_p_filter: re-exported)
    RequestLimits, StopRule, eos_ids, sample_rows, sample_tokens, top_k_top_p_filter,
)
from materl.engines.weights_seen import change_key
from materl.errors import ConfigError


LOOP_DEFAULTS = dict(read_every=8, continuous=True, kv_reuse=True, prefill_tokens=8192, capture=None)


@dataclass
class EngineStats:
    """Counters for benchmarks: how well requests were coalesced and how fast decoding ran."""

    batches: int = 0
    requests: int = 0
    tokens: int = 0
    decode_s: float = 0.0
    largest_batch: int = 0
    prefilled_tokens: int = 0  # prompt tokens computed (device loop)
    reused_tokens: int = 0  # prompt tokens taken from a kept or shared cache (device loop)

    @property
    def mean_batch_size(self) -> float:
        return self.requests / self.batches if self.batches else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.decode_s if self.decode_s else 0.0


@dataclass(eq=False)
class _Row:
    """Decode state of one request inside a batch."""

    request: Request
    rule: StopRule
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None


@ENGINES.register("transformers")
class TransformersEngine:
    """In-process engine: coalesces concurrent requests into batched decodes in a thread."""

    runs_on_cuda = True
    deterministic_options = {"max_batch": 1}  # a row's arithmetic depends on its batch (module docstring)

    def __init__(self, model, tokenizer, *, max_batch: int = 64, batch_window_s: float = 0.0,
                 pack_weights: bool = True, dtype: torch.dtype | None = None, static_cache: bool | None = None,
                 device_loop: bool | None = None, read_every: int = LOOP_DEFAULTS["read_every"],
                 continuous: bool = LOOP_DEFAULTS["continuous"], kv_reuse: bool = LOOP_DEFAULTS["kv_reuse"],
                 capture: str | None = LOOP_DEFAULTS["capture"], prefill_tokens: int = LOOP_DEFAULTS["prefill_tokens"]):
        """``dtype``: what decoding computes in (default: bf16 when the model is on CUDA, through
        a bf16 copy of the weights; fp32 on a CPU, where nothing changes).
        ``device_loop``: decode with the device loop (``device_loop.py``: sampling and stop checks
        on the device, continuous batching, each episode's KV kept across turns; default: on for
        a Llama/Qwen2 model on CUDA), with ``read_every`` steps between read-backs,
        ``continuous``, ``kv_reuse``, ``prefill_tokens`` per round and ``capture`` ("graph": raw
        CUDA graphs, the CUDA default; "compile": torch.compile then graphs; "none").
        ``static_cache`` (without the device loop): decode on static KV-cache slots, steps
        captured as CUDA graphs on CUDA (``static_decode.py``; default: on for CUDA)."""
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ConfigError(f"max_batch must be an int >= 1, got {max_batch!r}")
        if batch_window_s < 0:
            raise ConfigError(f"batch_window_s must be >= 0, got {batch_window_s!r}")
        self.model = model
        self.tokenizer = tokenizer
        device = _device_of(model)
        self.dtype = compute_dtype(device, dtype)
        static = device.type == "cuda" if static_cache is None else bool(static_cache)
        self.static = StaticDecoder(capture=device.type == "cuda") if static else None
        loop_options = dict(read_every=read_every, continuous=continuous, kv_reuse=kv_reuse,
                            prefill_tokens=prefill_tokens, capture=capture)
        self.loop = self._device_loop(model, device, device_loop, loop_options, max_batch)
        self._lowp, self._lowp_stale = None, False  # the decode copy in ``dtype`` (CUDA, bf16/fp16)
        self.max_batch = max_batch
        self.batch_window_s = batch_window_s
        self.stats = EngineStats()
        # decode-time packed copies of the linear weights (CPU; see decode_weights.py)
        self.decode_weights = DecodeWeights(enabled=pack_weights)
        # Held while a decode runs; a learner that updates the same model in another thread
        # while rollouts continue should hold it around optimizer.step().
        self.model_lock = threading.Lock()
        self.arrivals = Arrivals(RequestLimits.of(model))
        self._weights_key: tuple | None = None  # the parameters' change_key at the last decode
        self.weights_version = 0  # the policy version of the weights it decodes with (recorded per generation)
        self.eos_ids = eos_ids(model, tokenizer)
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else min(self.eos_ids, default=0)

    def _device_loop(self, model, device: torch.device, wanted: bool | None, options: dict, max_batch: int):
        """The device loop if ``wanted`` (None: on CUDA where the model runs there); its options
        given without it are an error, not ignored."""
        fits = device_forward.supports(model)
        if wanted and not fits:
            raise ConfigError(f"device_loop=True needs a Llama/Qwen2-style decoder with full attention; "
                              f"got {type(causal_lm_of(model)).__name__}")
        use = (device.type == "cuda" and fits) if wanted is None else bool(wanted)
        if not use:
            given = sorted(k for k, v in options.items() if v != LOOP_DEFAULTS[k])
            if given:
                raise ConfigError(f"engine options {given} apply to the device loop, which is off here "
                                  f"(device_loop={wanted!r}, device {device}); pass device_loop=True")
            return None
        capture = options["capture"] or ("graph" if device.type == "cuda" else "none")
        return DeviceLoop(self.tokenizer, frozenset(),
                          options=LoopOptions(**{**options, "capture": capture}, max_rows=max_batch))


    @classmethod
    def for_agent(cls, agent, **options) -> "TransformersEngine":
        return cls(agent.model, agent.tokenizer, **{"dtype": agent.compute_dtype, **options})

    def __repr__(self) -> str:
        return (f"TransformersEngine(max_batch={self.max_batch}, batches={self.stats.batches}, "
                f"mean_batch={self.stats.mean_batch_size:.1f})")

    # -- public API -------------------------------------------------------------------------

    async def generate(self, prompt_ids: list[int], params: SamplingParams | None = None) -> Generation:
        """Sample a continuation of ``prompt_ids``; see the module docstring for batching."""
        req = self.arrivals.new(prompt_ids, params)
        if req.empty() is not None:
            return req.empty()
        if self.loop is None:
            return await self.arrivals.serve(req, self._drive_batches)
        return await self.arrivals.serve(req, self._drive_rounds, self._loop_requests)

    def sync_weights(self) -> None:
        """The engine decodes with the agent's own model object, so it always sees the current
        weights; this only drops the packed decode copies of the old ones (and marks a
        lower-precision decode copy stale: refreshed in place before the next decode)."""
        self.decode_weights.clear()
        self._lowp_stale = True
        if self.loop is not None:
            self.loop.forget()

    def sleep(self) -> None:
        """Free decode-only memory (the packed copies of trainable weights) while the learner
        runs; the next ``generate`` rebuilds them."""
        self.decode_weights.clear()

    async def aclose(self) -> None:
        self.arrivals.waiting.clear()

    # -- batching ---------------------------------------------------------------------------

    async def _drive_batches(self, req: Request) -> None:
        """Run batches (oldest requests first) until ``req`` has its result."""
        while not req.done:
            await self.arrivals.tick(self.batch_window_s)
            batch = self.arrivals.take(self.max_batch)
            with anyio.CancelScope(shield=True):  # the thread finishes anyway; deliver results
                try:
                    results = await compute.acall(self._decode_batch, batch)
                except Exception as exc:  # noqa: BLE001 - handed to every waiter
                    finish(batch, error=exc)
                else:
                    finish(batch, results)

    async def _drive_rounds(self, req: Request) -> None:
        """Run device-loop rounds until ``req`` has its result; newcomers join between rounds."""
        while not req.done:
            if not self.loop.busy:  # idle: let a burst of requests (a GRPO group) arrive together
                await self.arrivals.tick(self.batch_window_s)
            admitted = self.arrivals.take(len(self.arrivals.waiting))
            with anyio.CancelScope(shield=True):  # the round finishes anyway; deliver its results
                try:
                    finished = await compute.acall(self._decode_round, admitted)
                except Exception as exc:  # noqa: BLE001 - handed to every request in the loop
                    finish(list({id(r): r for r in admitted + self.loop.reset()}.values()), error=exc)
                else:
                    finish(finished)

    def _loop_requests(self) -> list[Request]:
        return [s.request for s in self.loop.seqs.values()] + self.loop.ready

    def _decode_round(self, admitted: list[Request]) -> list[Request]:
        before = self.loop.stats.steps
        self.loop.eos = self.eos_ids  # (a benchmark may turn eos off)
        with self._decoding() as lm:
            finished = self.loop.round(lm, admitted, self.weights_version)
        s = self.stats
        s.requests += len(admitted)
        s.tokens += sum(len(r.result.token_ids) for r in finished)
        s.batches += self.loop.stats.steps > before
        s.largest_batch = max(s.largest_batch, len(self.loop.seqs) + len(finished))
        s.prefilled_tokens, s.reused_tokens = self.loop.stats.prefilled_tokens, self.loop.stats.reused_tokens
        return finished

    @contextmanager
    def _decoding(self):
        """The model that decodes (``_decode_model``) in eval mode, under no_grad and the
        engine's lock, timed into ``stats.decode_s``."""
        self._see_weight_changes()
        lm = self._decode_model(causal_lm_of(self.model))
        start = time.perf_counter()
        with self.model_lock, self.decode_weights.installed(lm):
            was_training = lm.training
            lm.eval()
            try:
                with torch.no_grad(), autocast(_device_of(lm), self.dtype if _dtype_of(lm) == torch.float32
                                                             else torch.float32):  # a low-precision copy: no autocast
                    yield lm
            finally:
                lm.train(was_training)
                self.stats.decode_s += time.perf_counter() - start

    def _decode_batch(self, batch: list[Request]) -> list[Generation]:
        with self._decoding() as lm:
            gens = self._decode(lm, batch)
        s = self.stats
        s.batches += 1
        s.requests += len(batch)
        s.tokens += sum(len(g.token_ids) for g in gens)
        s.largest_batch = max(s.largest_batch, len(batch))
        return gens

    def _see_weight_changes(self) -> None:
        """``sync_weights`` when the parameters changed since the last decode without it being
        called (``weights_seen.change_key``: a fused optimizer step bumps no version counter),
        so no kept cache or low-precision copy of the old weights is decoded with."""
        key = change_key(self.model.parameters())
        if self._weights_key is not None and key != self._weights_key:
            self.sync_weights()
        self._weights_key = key

    def _decode_model(self, lm):
        """What decodes: ``lm`` itself, or on CUDA with a bf16/fp16 ``dtype`` over fp32 weights a
        copy of it in ``dtype``, made once and refreshed in place after each weight change (in
        place: captured decode graphs keep reading the same addresses). Autocast would instead cast
        every fp32 weight on every decode step, three times the memory traffic of reading bf16."""
        device = _device_of(lm)
        if device.type != "cuda" or self.dtype == torch.float32 or _dtype_of(lm) != torch.float32:
            return lm
        if self._lowp is None:
            import copy

            self._lowp = copy.deepcopy(lm).to(self.dtype).requires_grad_(False)
        elif self._lowp_stale:
            with torch.no_grad():
                for mine, theirs in zip(self._lowp.parameters(), lm.parameters(), strict=True):
                    mine.copy_(theirs)
        self._lowp_stale = False
        return self._lowp

    # -- decode loop ------------------------------------------------------------------------

    def _decode(self, lm, batch: list[Request]) -> list[Generation]:
        version = self.weights_version  # weights change only between batches (both run in the compute thread)
        if self.static is not None:
            return self.static.decode(self, lm, batch, version)
        device = next(lm.parameters()).device
        rows = [self._new_row(r) for r in batch]
        # Identical prompts (a GRPO group) are prefilled once; their cache rows are then copied.
        distinct: dict[tuple[int, ...], int] = {}
        owner = [distinct.setdefault(tuple(r.prompt_ids), len(distinct)) for r in batch]
        input_ids, mask = _left_pad([list(p) for p in distinct], self.pad_id, device)
        cache = decode_cache(lm.config, reserve=max(r.params.max_new_tokens for r in batch))
        out = lm(input_ids=input_ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                 use_cache=True, logits_to_keep=1, **cache_kwargs(lm, cache))
        logits = out.logits[:, -1, :]
        if len(distinct) < len(batch):
            index = torch.tensor(owner, device=device)
            cache.batch_select_indices(index)
            mask, logits = mask[index], logits[index]
        active = list(range(len(rows)))  # rows[active[j]] is batch row j
        while True:
            live = [rows[i] for i in active]
            tokens = self._step(logits, live)
            keep = [j for j, row in enumerate(live) if row.finish is None]
            if not keep:
                break
            if len(keep) < len(active):
                index = torch.tensor(keep, device=device)
                cache.batch_select_indices(index)
                mask, tokens = mask[index], tokens[index]
                active = [active[j] for j in keep]
            mask = torch.cat([mask, mask.new_ones(len(active), 1)], dim=-1)
            out = lm(input_ids=tokens[:, None], attention_mask=mask, position_ids=mask.sum(-1, keepdim=True) - 1,
                     use_cache=True, **cache_kwargs(lm, cache))
            logits = out.logits[:, -1, :]
        return [self._finish(row, len(batch), version) for row in rows]

    def _new_row(self, req: Request) -> _Row:
        return _Row(req, StopRule.of(req.params, self.eos_ids))

    def _step(self, logits_B_V: Tensor, rows: list[_Row]) -> Tensor:
        """Sample one token for every live row, record it and apply the stop rules."""
        tokens, logprobs = sample_rows(logits_B_V, [r.request.params for r in rows], [r.request.seed for r in rows],
                                       [len(r.ids) for r in rows])
        for row, tok, lp in zip(rows, tokens, logprobs):
            row.ids.append(tok)
            row.logprobs.append(lp)
            row.finish = row.rule.reason(row.ids, self.tokenizer)
        return torch.tensor(tokens, device=logits_B_V.device)

    def _finish(self, row: _Row, batch_size: int, version: int) -> Generation:
        text = self.tokenizer.decode(row.ids, skip_special_tokens=False)
        meta = {"text": text, "batch_size": batch_size, "seed": row.request.seed, "version": version}
        return Generation(row.ids, row.logprobs, row.finish or "length",
                          prompt_len=len(row.request.prompt_ids), metadata=meta)


# --------------------------------------------------------------------------------- helpers


def _device_of(model) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _dtype_of(model) -> torch.dtype:
    param = next(model.parameters(), None)
    return param.dtype if param is not None else torch.float32
