"""Generation through a forward pass written in Mojo, with continuous batching.

    engine = MojoEngine(model, tokenizer, threads=2)
    gen = await engine.generate(prompt_ids, SamplingParams(max_new_tokens=32, seed=1))
    agent = ml.Agent("smollm2-135m-instruct", engine="mojo")  # falls back to "transformers", warning why

Models: HF Llama-family decoders (Llama, SmolLM2, the tiny random model, Qwen2-style with qkv
biases; tied or untied LM head), float32 weights read in place from the torch parameters
(``mojo_model.py``), LoRA layers merged. ``kernels/llama_engine.mojo`` runs the whole model
for a set of rows, one row per token: prefill, decode, or both at once.

Scheduling. Requests join and leave between decode steps. Each step, in materl's compute
thread: new requests are admitted (up to ``max_batch`` running) and their prompts fed (at most
``prefill_chunk`` prompt tokens a step), every running request feeds its last sampled token, one
forward pass runs over all of those rows, the requests that got logits sample a token, and
requests that stop return to their callers at once. A prompt prefix already in a cache is not
computed again (``mojo_prefix.py``): identical prompts admitted together run once, a prompt
sharing a prefix with a running or recently finished request (a system prompt, a multi-turn
episode's previous turn) copies those positions, and requests admitted together compute a
shared prefix once. The event loop runs between steps, so an episode whose
turn ended calls its tool while the others keep decoding, and its next turn joins the running
batch. One of the waiting ``generate`` calls drives the steps; when its own request is done it
hands that role to another.

Why a seeded request gives the same tokens whatever shares its batch and whatever the load:
  1. Rows are independent by construction. A row is one token of one request with its own
     position and its own KV cache: no padding, no mask, no position shared between requests.
  2. Every number a row produces is computed the same way every time: each matmul output
     element by eight float32 FMA lanes over k in order, then a fixed reduction tree
     (``kernels/llama/gemm.mojo``), RMSNorm, RoPE and attention per row (attention per (row,
     kv head) over that row's cache), sampling per row. Tiles, the number of rows, the thread
     count and which thread computes an element change which loads are shared, never the
     arithmetic; there are no atomics on data and no reductions across threads. So a row's
     logits are the same bits alone or in a batch of 64, on an idle or a loaded machine, and a
     prompt's cache is the same bits whether it was fed in one step, in chunks, token by token
     or copied from an identical prompt.
  3. The draw uses one uniform per token from ``counter_uniforms(seed, token index)`` (the
     request's ``params.seed``), the same draws as the transformers engine.
Load only changes when rows run, never what they compute. (Not guaranteed: the same bits as the
transformers engine, which sums in a different order; tokens agree unless a draw falls within
rounding of a CDF boundary, and log-probs agree to ~1e-5.)
"""

from __future__ import annotations

import threading
import time
import warnings
from dataclasses import dataclass, field

import anyio
import torch

from materl import compute
from materl.engines.arrivals import Arrivals, Request
from materl.engines.base import ENGINES, Generation, SamplingParams
from materl.engines.mojo_forward import MojoForward, Row, new_cache
from materl.engines.mojo_model import ModelTable
from materl.engines.mojo_prefix import PrefixPool, common_prefix
from materl.engines.sampling import RequestLimits, StopRule, counter_uniforms, eos_ids, seed_words
from materl.engines.weights_seen import change_key
from materl.errors import ConfigError, EngineError, KernelError
from materl.kernels import loader

KERNEL = "llama_engine"
FALLBACK_OPTIONS = ("max_batch", "batch_window_s")  # what the transformers engine takes of ours


@dataclass
class MojoEngineStats:
    """Counters for benchmarks."""

    steps: int = 0
    requests: int = 0
    tokens: int = 0  # sampled
    prompt_tokens: int = 0  # prompt positions computed
    reused_tokens: int = 0  # prompt positions copied from a cache or computed once for several requests
    decode_s: float = 0.0
    largest_batch: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.decode_s if self.decode_s else 0.0


@dataclass(eq=False)
class _Seq:
    """A running request: its cache, how much of it is filled, what it sampled."""

    request: Request
    rule: StopRule
    cache: torch.Tensor
    fed: int = 0  # positions of the cache filled
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    copies: "_Seq | None" = None  # an identical prompt admitted with it, whose cache and logits it reuses
    share: "tuple[_Seq, int] | None" = None  # (a request admitted with it, how many prompt tokens they share)
    peers: int = 1  # the most requests that shared a step with it
    version: int = 0  # the policy version of the weights of its first step (its cache holds their K/V)
    epoch: int = 0  # which weights (counted by _check_weights) computed its cache

    @property
    def prompt(self) -> list[int]:
        return self.request.prompt_ids

    def cached(self) -> list[int]:
        """The tokens whose keys and values its cache holds."""
        return (self.prompt + self.ids)[: self.fed]


def mojo_available() -> tuple[bool, str]:
    """Whether the Mojo engine's kernel builds and loads here, and if not, why."""
    if loader.disabled():
        return False, "MATERL_DISABLE_MOJO=1"
    try:
        loader.compile_file(loader.kernel_dir() / f"{KERNEL}.mojo")
    except KernelError as exc:
        return False, str(exc).splitlines()[0]
    return True, ""


@ENGINES.register("mojo")
class MojoEngine:
    """In-process engine whose forward pass is Mojo; see the module docstring."""

    runs_on_cuda = False  # the Mojo forward is CPU code
    deterministic_options: dict = {}  # rows are independent of their batch by construction

    def __init__(self, model, tokenizer, *, max_batch: int = 64, batch_window_s: float = 0.005,
                 threads: int | None = None, prefill_chunk: int = 512, prefix_cache_mb: int = 512):
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ConfigError(f"max_batch must be an int >= 1, got {max_batch!r}")
        if batch_window_s < 0:
            raise ConfigError(f"batch_window_s must be >= 0, got {batch_window_s!r}")
        if not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise ConfigError(f"prefill_chunk must be an int >= 1, got {prefill_chunk!r}")
        if not isinstance(prefix_cache_mb, int) or prefix_cache_mb < 0:
            raise ConfigError(f"prefix_cache_mb must be an int >= 0 (0: keep no finished caches), "
                              f"got {prefix_cache_mb!r}")
        threads = torch.get_num_threads() if threads is None else threads
        if not isinstance(threads, int) or threads < 1:
            raise ConfigError(f"threads must be an int >= 1, got {threads!r}")
        ok, why = mojo_available()
        if not ok:
            raise EngineError(f"the Mojo engine is unavailable: {why}")
        self.model = model
        self.tokenizer = tokenizer
        self.table = ModelTable(model)  # EngineError if the model is not one the kernel runs
        self.forward = MojoForward(loader.compile_file(loader.kernel_dir() / f"{KERNEL}.mojo"), threads=threads)
        self.max_batch = max_batch
        self.batch_window_s = batch_window_s
        self.prefill_chunk = prefill_chunk
        self.stats = MojoEngineStats()
        self.model_lock = threading.Lock()  # held during a step; see TransformersEngine.model_lock
        self.eos_ids = eos_ids(model, tokenizer)
        self.pool = PrefixPool(prefix_cache_mb << 20)
        self._params: list | None = None
        self._weights_seen: tuple | None = None
        self._epoch = 0  # bumped whenever the weights change: caches of older epochs are not shared
        self.arrivals = Arrivals(RequestLimits.of(model))  # event-loop side
        self._running: list[_Seq] = []  # compute-thread side (touched only inside a step)
        self.weights_version = 0  # the policy version of the weights it decodes with (recorded per generation)

    @classmethod
    def for_agent(cls, agent, *, warn: bool | None = None, **options):
        """The engine for ``agent``; the transformers engine (with a ``MojoFallbackWarning`` if
        ``warn``; default: when the agent asked for "mojo" by name, ``agent.engine_explicit``)
        when Mojo is unavailable or the model is not one the Mojo forward runs. The
        transformers engine gets ``max_batch``/``batch_window_s``; the other options are this
        engine's own (the warning names them)."""
        try:
            return cls(agent.model, agent.tokenizer, **options)
        except EngineError as exc:
            from materl.engines.transformers_engine import TransformersEngine

            if warn if warn is not None else getattr(agent, "engine_explicit", True):
                dropped = sorted(set(options) - set(FALLBACK_OPTIONS))
                note = f" (options {dropped} are the Mojo engine's)" if dropped else ""
                warnings.warn(f"materl: engine 'mojo' unavailable for {agent.name!r}, using 'transformers'{note}: "
                              f"{exc}", loader.MojoFallbackWarning, stacklevel=3)
            kept = {k: v for k, v in options.items() if k in FALLBACK_OPTIONS}
            return TransformersEngine.for_agent(agent, **kept)

    def __repr__(self) -> str:
        return (f"MojoEngine(threads={self.forward.threads}, max_batch={self.max_batch}, "
                f"steps={self.stats.steps}, requests={self.stats.requests})")

    # -- public API -------------------------------------------------------------------------

    async def generate(self, prompt_ids: list[int], params: SamplingParams | None = None) -> Generation:
        """Sample a continuation of ``prompt_ids``; see the module docstring for batching."""
        req = self.arrivals.new(prompt_ids, params)
        if req.empty() is not None:
            return req.empty()
        for seq in self._running:  # requests of an event loop that is gone
            if seq.request.token != req.token:
                seq.request.cancelled = True
        return await self.arrivals.serve(req, self._drive, lambda: [s.request for s in self._running])

    def sync_weights(self) -> None:
        """The forward reads the agent's parameters in place, so an in-place update needs no copy;
        the next step re-reads which tensors the model holds, re-merges the LoRA layers whose
        weights changed (``mojo_model.ModelTable``) and forgets cached prefixes. (Each step also
        checks every parameter's storage, version and optimizer steps (``weights_seen``), so a
        change made without this call, a fused optimizer's step included, is seen too.)"""
        self.table.invalidate()
        self.pool.clear()
        self._params = None

    def sleep(self) -> None:
        """Free decode-only memory while the learner runs: merged copies of trainable weights,
        kept prefixes and the workspace (rebuilt by the next step)."""
        self.table.clear()
        self.pool.clear()
        self.forward.release()

    async def aclose(self) -> None:
        self.arrivals.waiting.clear()
        self.forward.close()

    # -- scheduling (event loop) ---------------------------------------------------------------

    async def _drive(self, req: Request) -> None:
        """Run steps until ``req`` has its result."""
        while not req.done:
            if not self._running:  # idle: let a burst of requests (a GRPO group) arrive together
                await self.arrivals.tick(self.batch_window_s)
            admitted = self.arrivals.take(self.max_batch - len(self._running))
            with anyio.CancelScope(shield=True):  # the step finishes anyway; deliver its results
                try:
                    finished = await compute.acall(self._step, admitted)
                except Exception as exc:  # noqa: BLE001 - handed to every request of the step
                    finished = admitted + [s.request for s in self._running]
                    self._running = []
                    for r in finished:
                        r.error = exc
            for r in finished:
                r.wake.set()

    # -- one step (compute thread) -----------------------------------------------------------------

    def _step(self, admitted: list[Request]) -> list[Request]:
        """Admit, run one forward over every running request, sample; return finished requests."""
        start = time.perf_counter()
        with self.model_lock, torch.no_grad():
            self._check_weights()
            self._running = [s for s in self._running if not s.request.cancelled]
            for seq in self._running:
                if seq.copies is not None and seq.copies.request.cancelled:
                    seq.copies = None  # what it was to copy is gone: it runs its own prompt
            self._running += self._admit([r for r in admitted if not r.cancelled])
            rows, sampling, mirrors = self._plan()
            finished = self._run(rows, sampling, mirrors) if sampling or rows else []
        s = self.stats
        s.steps += 1
        s.decode_s += time.perf_counter() - start
        s.largest_batch = max(s.largest_batch, len(self._running) + len(finished))
        return finished

    def _check_weights(self) -> None:
        """Re-read the model table and forget kept prefixes if any parameter changed in place
        (or was given new storage) since the last step. The parameter list itself (walking the
        modules costs milliseconds) is re-read after ``sync_weights`` and when a batch starts
        from idle, which is when a parameter object can have been replaced."""
        if self._params is None or not self._running:
            self._params = list(self.model.parameters())
        seen = change_key(self._params)
        if seen != self._weights_seen:
            self.table.invalidate()
            self.pool.clear()
            self._weights_seen = seen
            self._epoch += 1

    def _admit(self, requests: list[Request]) -> list[_Seq]:
        """New sequences, each reusing what it can of a cached or co-admitted prompt prefix."""
        shape = self.table.shape
        seqs, first = [], {}
        for r in requests:
            seq = _Seq(r, StopRule.of(r.params, self.eos_ids),
                       new_cache(shape, len(r.prompt_ids) + r.params.max_new_tokens),
                       version=self.weights_version, epoch=self._epoch)
            twin = first.setdefault(tuple(r.prompt_ids), seq)
            if twin is not seq:
                seq.copies = twin  # the same prompt: its cache and its last logits
                self.stats.reused_tokens += len(seq.prompt)
            else:
                self._reuse(seq, seqs)
            seqs.append(seq)
        self.stats.requests += len(requests)
        return seqs

    def _reuse(self, seq: _Seq, admitted: list[_Seq]) -> None:
        """Copy the longest cached prefix of the prompt (all but its last token, whose logits the
        request needs) or, if a request admitted with it shares a longer one, plan to mirror it."""
        limit = len(seq.prompt) - 1
        best, length = self.pool.best(seq.prompt, limit)
        source = best.cache if best is not None else None
        for other in self._running:
            if other.epoch != seq.epoch:  # its cache holds keys and values of older weights
                continue
            n = min(common_prefix(seq.prompt, other.cached()), limit)
            if n > length:
                source, length = other.cache, n
        for other in admitted:
            n = min(common_prefix(seq.prompt, other.prompt), limit)
            if other.copies is None and n > max(length, seq.share[1] if seq.share else 0):
                seq.share = (other, n)
        if seq.share is not None:
            return
        if length:
            seq.cache[:, :, :, :length] = source[:, :, :, :length]
            seq.fed = length
            self.stats.reused_tokens += length

    def _plan(self) -> tuple[list[Row], list[_Seq], list[tuple[int, torch.Tensor]]]:
        """This step's rows, the sequences that sample after it (in logit-row order) and the
        mirrors (a computed row's keys and values also written into another request's cache)."""
        rows: list[Row] = []
        sampling: list[_Seq] = []
        mirrors: list[tuple[int, torch.Tensor]] = []
        rows_of: dict[int, list[int]] = {}  # per request fed from position 0 this step: the row of each position
        self._logit_rows: list[int] = []
        budget = self.prefill_chunk
        for seq in self._running:
            if seq.copies is not None:
                continue
            if seq.fed < len(seq.prompt):  # prefill: the next chunk of the prompt
                shared = self._mirror(seq, rows_of, mirrors)
                start, take = seq.fed, min(len(seq.prompt) - seq.fed, budget)
                if take <= 0:
                    continue
                rows += [Row(t, start + i, seq.cache) for i, t in enumerate(seq.prompt[start : start + take])]
                if start == len(shared):
                    rows_of[id(seq)] = shared + list(range(len(rows) - take, len(rows)))
                budget -= take
                self.stats.prompt_tokens += take
                seq.fed += take
                if seq.fed < len(seq.prompt):
                    continue
            else:  # decode: the last sampled token
                rows.append(Row(seq.ids[-1], seq.fed, seq.cache))
                seq.fed += 1
            sampling.append(seq)
            self._logit_rows.append(len(rows) - 1)
        return rows, sampling, mirrors

    def _mirror(self, seq: _Seq, rows_of: dict[int, list[int]], mirrors: list) -> list[int]:
        """If ``seq`` shares a prefix with a request whose rows for it run in this step, mirror
        them into its cache; returns the rows of its positions so shared (or [])."""
        if seq.share is None:
            return []
        donor, length = seq.share
        seq.share = None
        donor_rows = rows_of.get(id(donor), [])
        if seq.fed or len(donor_rows) < length:  # the donor's prefix is not computed this step
            return []
        mirrors += [(row, seq.cache) for row in donor_rows[:length]]
        seq.fed = length
        self.stats.reused_tokens += length
        return donor_rows[:length]

    def _run(self, rows: list[Row], sampling: list[_Seq], mirrors: list) -> list[Request]:
        copies = [s for s in self._running if s.copies is not None and s.copies in sampling]
        logit_rows = self._logit_rows + [self._logit_rows[sampling.index(s.copies)] for s in copies]
        sampling = sampling + copies
        params = [s.request.params for s in sampling]
        lo, hi = seed_words([s.request.seed for s in sampling])
        uniforms = counter_uniforms(lo, hi, torch.tensor([len(s.ids) for s in sampling], dtype=torch.long)).tolist()
        tokens, logprobs = self.forward.sample(self.table, rows, logit_rows, params, uniforms, mirrors=mirrors)
        for seq in copies:  # the prompt ran once; its cache is the same bits for every copy
            n = len(seq.prompt)
            seq.cache[:, :, :, :n] = seq.copies.cache[:, :, :, :n]
            seq.fed, seq.copies = n, None
        finished = []
        for seq, tok, lp in zip(sampling, tokens, logprobs):
            seq.ids.append(tok)
            seq.logprobs.append(lp)
            seq.peers = max(seq.peers, len(self._running))
            reason = seq.rule.reason(seq.ids, self.tokenizer)
            if reason is not None:
                seq.request.result = self._generation(seq, reason)
                finished.append(seq.request)
                self.pool.add(seq.cached(), seq.cache)
        self.stats.tokens += len(sampling)
        done = {id(r) for r in finished}
        self._running = [s for s in self._running if id(s.request) not in done]
        return finished

    def _generation(self, seq: _Seq, reason: str) -> Generation:
        text = self.tokenizer.decode(seq.ids, skip_special_tokens=False)
        meta = {"text": text, "batch_size": seq.peers, "seed": seq.request.seed, "version": seq.version}
        return Generation(seq.ids, seq.logprobs, reason, prompt_len=len(seq.prompt), metadata=meta)
