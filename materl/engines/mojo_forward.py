"""Run ``kernels/llama_engine.mojo`` over a set of rows with several threads.

    forward = MojoForward(kernel, threads=2)
    logits_R_V = forward.logits(table, rows, logit_rows)     # rows: (token, position, cache) each
    tokens, logprobs = forward.sample(table, rows, logit_rows, params, uniforms, mirrors=[(row, cache)])

Mojo 1.2.0 has no ``parallelize``, so the threads are Python threads: ``threads - 1`` helper
threads wait on a queue, and each forward hands every helper its thread index and runs index 0
in the calling thread (materl's compute thread); ctypes releases the GIL, so all of them run
the kernel at once, sharing its work through atomic counters (``kernels/llama/sync.mojo``). The helpers
never run torch code, so they add no OpenMP pool (``materl/compute.py`` explains why that
matters). A call uses all the threads or only the calling one, whichever has been faster lately
(``ThreadChooser``): on a machine whose cores are busy with other processes, threads that keep
waiting for a descheduled peer lose to one thread. The results are the same bits either way.

A KV cache is one float32 tensor per request, shaped (layers, 2, kv_heads, capacity, head_dim):
keys then values of every layer for positions 0..capacity-1. A mirror ``(row, cache)`` writes
that row's keys and values into ``cache`` too, at the row's position: a prompt prefix shared by
requests admitted together is computed once.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from materl.engines.base import SamplingParams
from materl.engines.mojo_model import ModelTable, Shape
from materl.errors import EngineError

# Step table layout: mirrors the S_* constants of kernels/llama_engine.mojo.
S_FIELDS = 21
ERRORS = {1: "a token id outside the vocabulary", 2: "a position outside its KV cache",
          3: "a position past the RoPE table", 4: "a workspace too small", 5: "a bad thread index"}


@dataclass(frozen=True)
class Row:
    """One token to run: its id, its position, and the KV cache of its request."""

    token: int
    position: int
    cache: Tensor


def new_cache(shape: Shape, capacity: int) -> Tensor:
    return torch.empty(shape.layers, 2, shape.kv_heads, capacity, shape.head_dim, dtype=torch.float32)


def workspace_floats(shape: Shape, rows: int, logit_rows: int, threads: int, context: int) -> int:
    """Scratch floats one forward needs; mirrors ``Work`` in kernels/llama_engine.mojo."""
    s = shape
    shared = rows * (s.hidden + 2 * s.heads * s.head_dim + 2 * s.inter)
    private = (max(rows, logit_rows) * s.hidden + rows * s.head_dim + (s.heads // s.kv_heads) * (context + 1)
               + 2 * s.vocab)
    return shared + threads * private


def _sampling_inputs(params: list[SamplingParams], uniforms: list[float]) -> tuple[Tensor, Tensor]:
    f64 = torch.tensor([[p.temperature if p.temperature > 0 else 1.0, p.top_p, u]
                        for p, u in zip(params, uniforms)], dtype=torch.float64)
    i64 = torch.tensor([[p.top_k, int(p.greedy or p.temperature == 0)] for p in params], dtype=torch.int64)
    return f64, i64


def sample_logits(kernel, logits_R_V: Tensor, params: list[SamplingParams], uniforms: list[float]
                  ) -> tuple[list[int], list[float]]:
    """The forward's sampling phase on given float32 logits (one thread): tokens and log-probs."""
    logits = logits_R_V.float().contiguous()
    rows, vocab = logits.shape
    f64, i64 = _sampling_inputs(params, uniforms)
    tokens = torch.zeros(rows, dtype=torch.int64)
    logprobs = torch.zeros(rows, dtype=torch.float64)
    scratch = torch.empty(2 * vocab, dtype=torch.float32)
    kernel.call("llama_sample", "iiiiiiii", logits.data_ptr(), rows, vocab, f64.data_ptr(), i64.data_ptr(),
                tokens.data_ptr(), logprobs.data_ptr(), scratch.data_ptr())
    return tokens.tolist(), logprobs.tolist()


class _Helper:
    """A thread that runs the kernel's forward with a fixed thread index, on request."""

    def __init__(self, fn):
        self.fn = fn
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.done: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="materl-mojo-forward", daemon=True).start()

    def _serve(self) -> None:
        while True:
            args = self.jobs.get()
            if args is None:
                return
            try:
                self.done.put(self.fn(*args))
            except BaseException as exc:  # noqa: BLE001 - reported by the caller
                self.done.put(exc)


class ThreadChooser:
    """How many threads a forward uses: 1 or all, whichever had the lower recent cost (seconds
    per row, plus ``FIXED_ROWS`` for the weights every call streams). The other is tried now and
    then so a change in the machine's load is noticed: ``EXPLORE_FIRST`` calls after the choice
    last changed, then at twice the previous interval while the tries confirm it, up to
    ``EXPLORE_MAX``. (With a fixed interval of 8, every eighth decode step on an idle 2-core
    machine ran on one thread at 1.7x the time, and decoding was 7-15% slower.) Threads never
    change a result (the kernel's arithmetic does not depend on them), only the time.

    Decode calls (up to ``STREAM_ROWS`` rows: the kernel streams the weights, bandwidth-bound)
    and larger ones (prefill: compute-bound) keep separate estimates, because their cost per row
    differs: with one estimate, a rollout's first call, a prefill that also pays first-touch page
    faults, made two threads look 1.8 ms a row against one thread's 1.1 ms for decode steps, and
    the engine decoded on one thread (44 instead of 24 ms a step) until a try 8 and then 16
    calls later outweighed it."""

    EXPLORE_FIRST = 8
    EXPLORE_MAX = 128
    FIXED_ROWS = 32
    DECAY = 0.7  # weight of the old estimate
    STREAM_ROWS = 8  # kernels/llama/gemm.mojo: up to this many rows, a call streams the weights

    def __init__(self, threads: int):
        self.options = sorted({1, threads})
        self.used = {t: 0 for t in self.options}  # calls per thread count (benchmarks read it)
        self._kinds = {False: _Estimates(), True: _Estimates()}  # keyed by "more than STREAM_ROWS rows"

    def pick(self, rows: int = 1) -> int:
        k = self._kinds[rows > self.STREAM_ROWS]
        k.calls += 1
        untried = [t for t in self.options if t not in k.cost]
        if untried:
            return untried[-1]
        ranked = sorted(self.options, key=k.cost.__getitem__)
        if ranked[0] != k.best:  # a new choice (or the first): try the other soon
            k.best, k.interval = ranked[0], self.EXPLORE_FIRST
            k.next_try = k.calls + k.interval
        if len(ranked) > 1 and k.calls >= k.next_try:
            k.interval = min(2 * k.interval, self.EXPLORE_MAX)
            k.next_try = k.calls + k.interval
            return ranked[-1]
        return ranked[0]

    def record(self, threads: int, seconds: float, rows: int) -> None:
        self.used[threads] += 1
        k = self._kinds[rows > self.STREAM_ROWS]
        cost = seconds / (rows + self.FIXED_ROWS)
        old = k.cost.get(threads)
        k.cost[threads] = cost if old is None else self.DECAY * old + (1 - self.DECAY) * cost


@dataclass
class _Estimates:
    """One kind of call's cost per thread count and its exploration schedule (``ThreadChooser``)."""

    cost: dict[int, float] = field(default_factory=dict)
    calls: int = 0
    best: int | None = None
    interval: int = ThreadChooser.EXPLORE_FIRST
    next_try: int = 0


class MojoForward:
    """Forward passes of one model through the Mojo kernel; see the module docstring."""

    def __init__(self, kernel, *, threads: int):
        if not isinstance(threads, int) or threads < 1:
            raise EngineError(f"threads must be an int >= 1, got {threads!r}")
        self.fn = kernel.function("llama_forward", "iiiff")
        self.threads = threads
        self.chooser = ThreadChooser(threads)
        self._helpers = [_Helper(self.fn) for _ in range(threads - 1)]
        self._workspace = torch.empty(0, dtype=torch.float32)
        self._counters = torch.zeros(16, dtype=torch.int64)

    def close(self) -> None:
        """Stop the helper threads (later calls run in the calling thread alone: a chunk nobody
        else takes is taken by it, so nothing waits for a missing thread)."""
        for h in self._helpers:
            h.jobs.put(None)
        self._helpers = []

    def __del__(self):
        self.close()

    def release(self) -> None:
        """Free the workspace (it is reallocated by the next call)."""
        self._workspace = torch.empty(0, dtype=torch.float32)

    def logits(self, table: ModelTable, rows: list[Row], logit_rows: list[int], *,
               mirrors: list[tuple[int, Tensor]] = ()) -> Tensor:
        """Logits (len(logit_rows), vocab) of the given rows after running all of them."""
        return self._run(table, rows, logit_rows, None, None, mirrors)[0]

    def sample(self, table: ModelTable, rows: list[Row], logit_rows: list[int], params: list[SamplingParams],
               uniforms: list[float], *, mirrors: list[tuple[int, Tensor]] = ()) -> tuple[list[int], list[float]]:
        """Run the rows, then sample one token per logit row (``kernels/llama/sample.mojo``) with
        that row's params and uniform in [0, 1); returns the tokens and their log-probs."""
        f64, i64 = _sampling_inputs(params, uniforms)
        _, tokens, logprobs = self._run(table, rows, logit_rows, f64, i64, mirrors)
        return tokens.tolist(), logprobs.tolist()

    def _run(self, table: ModelTable, rows: list[Row], logit_rows: list[int], f64: Tensor | None,
             i64: Tensor | None, mirrors) -> tuple[Tensor, Tensor, Tensor]:
        shape = table.shape
        context = max(r.position for r in rows) + 1
        addresses = table.addresses(context)
        tokens = torch.tensor([r.token for r in rows], dtype=torch.int64)
        positions = torch.tensor([r.position for r in rows], dtype=torch.int64)
        caches = torch.tensor([r.cache.data_ptr() for r in rows], dtype=torch.int64)
        capacity = torch.tensor([r.cache.shape[3] for r in rows], dtype=torch.int64)
        index = torch.tensor(logit_rows, dtype=torch.int64)
        logits = torch.empty(len(logit_rows), shape.vocab, dtype=torch.float32)
        out_tokens = torch.zeros(len(logit_rows), dtype=torch.int64)
        out_logprobs = torch.zeros(len(logit_rows), dtype=torch.float64)
        mirror_rows = torch.tensor([r for r, _ in mirrors], dtype=torch.int64)
        mirror_kv = torch.tensor([c.data_ptr() for _, c in mirrors], dtype=torch.int64)
        mirror_cap = torch.tensor([c.shape[3] for _, c in mirrors], dtype=torch.int64)
        threads = self.chooser.pick(len(rows))
        need = workspace_floats(shape, len(rows), len(logit_rows), threads, context)
        if self._workspace.numel() < need:
            self._workspace = torch.empty(need, dtype=torch.float32)
        self._counters.zero_()
        step = torch.tensor([len(rows), len(logit_rows), threads, tokens.data_ptr(), positions.data_ptr(),
                             caches.data_ptr(), capacity.data_ptr(), index.data_ptr(), logits.data_ptr(),
                             self._workspace.data_ptr(), self._workspace.numel(), self._counters.data_ptr(), context,
                             f64.data_ptr() if f64 is not None else 0, i64.data_ptr() if i64 is not None else 0,
                             out_tokens.data_ptr(), out_logprobs.data_ptr(), len(mirrors), mirror_rows.data_ptr(),
                             mirror_kv.data_ptr(), mirror_cap.data_ptr()], dtype=torch.int64)
        assert step.numel() == S_FIELDS
        start = time.perf_counter()
        self._call(addresses.data_ptr(), step.data_ptr(), shape, threads)
        self.chooser.record(threads, time.perf_counter() - start, len(rows))
        return logits, out_tokens, out_logprobs

    def _call(self, addresses: int, step: int, shape: Shape, threads: int) -> None:
        helpers = self._helpers[: threads - 1]
        for i, helper in enumerate(helpers, start=1):
            helper.jobs.put((addresses, step, i, shape.eps, shape.scale))
        codes = [self.fn(addresses, step, 0, shape.eps, shape.scale)]
        codes += [h.done.get() for h in helpers]
        for code in codes:
            if isinstance(code, BaseException):
                raise EngineError(f"a Mojo forward thread failed: {code!r}") from code
            if code != 0:
                raise EngineError(f"the Mojo forward refused its input: {ERRORS.get(code, f'error code {code}')}")
