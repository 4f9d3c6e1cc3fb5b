"""The learner stage: batch tensors, prepare (no gradient), then epochs x mini-batches x
micro-batches of forward/backward, gradient clipping and an optimizer step per mini-batch.

Metrics an implementation returns per micro-batch are averaged over the update; whole-batch
metrics (the engine-vs-learner mismatch, the mean of a prepare node's per-episode figures) go in
``batch_metrics`` and are reported as set, or are computed after the loop from what micro-steps
``gather`` (over every process's rows).

Loss aggregations get the mini-batch's global token/sequence count as their denominator, so
summing micro-batch losses equals the mini-batch loss exactly (gradient accumulation is exact).
What each node does here is its implementation's ``prepare``/``learn`` (``materl.compiler.kinds``).

The batch is a ``LearnerBatch`` (``batch.py``): token rows and every per-episode value the update
reads, collated once, on the learner's device (its first trainable agent's), sliced per
micro-batch. A row is an episode, or one segment of an agent episode whose history was rewritten
(``batch.RowMap``): prepare's forwards, the update's micro-batches and the loss denominators run
over rows; ``trained_sequences`` reports how many. The optimizers are an ``OptimizerStep``
(``optimizers.Optimizers``) handed in.

Which rows of a mini-batch this process computes, the denominators, how forwards through
trainable weights run and how gradients meet are a ``Partition``: ``WholeBatch`` (one process,
every row) by default; ``materl.distributed`` gives each rank its share of the rows, with the
same global denominators, so the ranks' summed gradients are the whole mini-batch's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Protocol, TypeVar

import torch
from torch import Tensor

from materl import compute
from materl.compiler import graphs
from materl.compiler.batch import LearnerBatch, RowMap
from materl.compiler.context import StageEnv
from materl.compiler.episode import Episode, as_rollout
from materl.compiler.packing import MicroBatching
from materl.compiler.scheduler import call_batch
from materl.compiler.sequences import SeqBatch, build_seq_batch
from materl.compiler.spec import Kind, Role, output_of
from materl.errors import CompileError
from materl.graph.node import Node, ref_node

T = TypeVar("T")
Denominators = dict[str, dict[str, float]]  # completion set -> {"tokens": n, "seqs": n}
Micro = tuple[Tensor, float]  # (rows, weight): weight 0.0 runs the rows only to keep ranks in step


class OptimizerStep(Protocol):
    """What the learner steps after each mini-batch (``materl.compiler.optimizers.Optimizers``)."""

    def step(self) -> float:
        """Clip, step and zero every optimizer; the largest gradient norm."""


class Partition(Protocol):
    """How one process takes part in each mini-batch update."""

    def micro_batches(self, rows: Tensor, micro: MicroBatching) -> list[Micro]:
        """The micro-batches this process runs for mini-batch ``rows`` (global row indices), cut
        by ``micro`` (rows per micro-batch, or a token budget: ``materl.compiler.packing``)."""

    def denominators(self, learner: Learner, rows: Tensor) -> Denominators:
        """The token and sequence counts of the WHOLE mini-batch ``rows`` (every process's)."""

    def forward(self, fn: Callable[[], T]) -> T:
        """Run ``fn``, a prepare-time forward through a trainable agent's weights."""

    def forward_backward(self, fn: Callable[[], tuple[Tensor, dict]], *, weight: float,
                         last: bool) -> tuple[Tensor, dict]:
        """Run micro-step ``fn`` and backpropagate ``weight * loss``; ``last``: the mini-batch's
        last micro-step here (gradients may be reduced across processes then)."""

    def reduce(self, sums: dict[str, float]) -> dict[str, float]:
        """This process's metric sums -> the sums over every process."""

    def gather(self, scratch: dict[str, list]) -> dict[str, list]:
        """This process's gathered items per key -> every process's, in rank order."""


class WholeBatch:
    """One process computes every row: the single-process learner."""

    def micro_batches(self, rows: Tensor, micro: MicroBatching) -> list[Micro]:
        return [(idx, 1.0) for idx in micro.split(rows)]

    def denominators(self, learner: Learner, rows: Tensor) -> Denominators:
        return learner.denominators(rows)

    def forward(self, fn: Callable[[], T]) -> T:
        return fn()

    def forward_backward(self, fn, *, weight: float, last: bool) -> tuple[Tensor, dict]:
        loss, metrics = fn()
        (loss * weight if weight != 1.0 else loss).backward()
        return loss, metrics

    def reduce(self, sums: dict[str, float]) -> dict[str, float]:
        return sums

    def gather(self, scratch: dict[str, list]) -> dict[str, list]:
        return scratch


class Learner:
    """One batch of episodes through prepare and the update loop."""

    def __init__(self, run: StageEnv, episodes: list[Episode], optimizers: OptimizerStep, *,
                 partition: Partition | None = None):
        self.run, self.episodes, self.plan = run, episodes, run.plan
        self.optimizers = optimizers
        self.partition = partition or WholeBatch()
        self.device = learner_device(run.agents)
        self.batch = LearnerBatch(episodes, device=self.device, static=run.options.cuda_graphs, rows=self.row_map())
        self.timings: dict[str, float] = {}
        self.updates = 0  # optimizer steps taken on this batch: 0 while the weights are the step's start
        # whole-batch metrics set by implementations, not averaged
        self.batch_metrics: dict[str, float] = {"trained_sequences": float(len(self.batch))}
        self.scratch: dict[str, list] = {}  # what implementations gather across micro-batches (``gather``)
        self.finishers: dict[str, Callable[[list], dict[str, float]]] = {}
        self.padding = False  # the micro-step runs only to keep ranks in step (weight 0): gather nothing

    # -- batch tensors --
    def seq_batch(self, node: Node) -> SeqBatch:
        """The (prompt, completion) rows a forward node reads, built once per batch."""
        prompts_ref, comps_ref = self.sequence_refs(node)
        tokenizer = self.run.agent(node).tokenizer
        return self.batch.sequences((prompts_ref, comps_ref), lambda: build_seq_batch(
            tokenizer, self.batch.per_row([e.resolve(prompts_ref) for e in self.episodes], Kind.ROW),
            self.batch.per_row([e.resolve(comps_ref) for e in self.episodes], Kind.ROLLOUT)))

    def row_map(self) -> RowMap:
        """The batch's rows: one per episode, or per segment of a rewritten agent episode, from
        the completions the plan's forwards read (``RowMap.agreed``)."""
        plan = self.plan
        refs = {self.sequence_refs(plan.nodes[n])[1] for n in plan.order
                if plan.role(n) is Role.FORWARD and (n in plan.prepare or n in plan.live)}
        refs = {r for r in refs if all(ref_node(r) in e.values for e in self.episodes)}  # not made in prepare
        return RowMap.agreed({ref: RowMap.of([_rollout_or_none(e.resolve(ref)) for e in self.episodes])
                              for ref in sorted(refs)}) if refs else RowMap.identity(len(self.episodes))

    @staticmethod
    def sequence_refs(node: Node) -> tuple[str, str]:
        prompts_ref, comps_ref = [r for r in node.inputs if not r.startswith("@")][:2]
        return prompts_ref, comps_ref

    def forward_of(self, ref: str) -> Node:
        """The forward node whose (B, T) output ``ref`` reads (a loss's log-probs or values)."""
        node = self.plan.nodes[ref_node(ref)]
        if self.plan.role(node.name) is not Role.FORWARD:
            raise CompileError(f"node {node.name!r} (op {node.op}) is not a forward (logprobs, values)")
        return node

    def width(self) -> int | None:
        return self.batch.width

    # -- prepare: once per batch, no gradient --
    async def prepare(self, *, then: Callable[[], T] | None = None) -> T | None:
        """Run the prepare nodes in plan order: each run of forwards in one compute call (their
        values stored on the episodes there), the other nodes (advantages, shaped rewards) as
        batch calls in this event loop. ``then``: compute work to run once prepare is done, in
        the same compute call when prepare ends with forwards (a thread hop fewer each way); its
        result is returned. Sets ``timings["stage/prepare"]``."""
        t0, plan = time.perf_counter(), self.plan
        names = [n for n in plan.order if n in plan.prepare or (n in plan.live and plan.role(n) is Role.FORWARD)]
        i = 0
        while i < len(names):
            if plan.role(names[i]) is not Role.FORWARD:
                for ep, value in zip(self.episodes, await call_batch(self.run, names[i], self.episodes)):
                    ep.store(names[i], value)
                self.batch_metrics |= _episode_means(self.episodes, f"{names[i]}/")
                i += 1
                continue
            j = next((k for k in range(i, len(names)) if plan.role(names[k]) is not Role.FORWARD), len(names))
            if j == len(names) and then is not None:
                return await compute.acall(self.forwards, names[i:], then=then, t0=t0)
            await compute.acall(self.forwards, names[i:j])
            i = j
        self.timings["stage/prepare"] = time.perf_counter() - t0
        return None if then is None else await compute.acall(then)

    def forwards(self, names: list[str], *, then: Callable[[], T] | None = None, t0: float = 0.0) -> T | None:
        """Compute thread: prepare forwards ``names`` in order, each one's rows stored on the
        episodes (a live forward's are stored by the update); then ``then()`` (``prepare``)."""
        for name in names:
            impl, node = self.plan.impl(name), self.plan.nodes[name]
            run = self.partition.forward if self.run.agent(node).trainable else _call
            out = run(partial(impl.prepare, self, node, live=name in self.plan.live))
            for ep, row in zip(self.episodes, self.batch.per_episode(out) if out is not None else ()):
                ep.store(name, row)
        if then is None:
            return None
        self.timings["stage/prepare"] = time.perf_counter() - t0
        return then()

    # -- update --
    def micro_step(self, idx: Tensor, denoms: Denominators) -> tuple[Tensor, dict]:
        """Forward the live nodes for rows ``idx`` and return the weighted loss and metrics."""
        plan = self.plan
        graphs.step_begin(self.run.options.cuda_graphs and self.device.type == "cuda")
        env: dict[str, Tensor] = {}
        metrics: dict[str, float] = {}

        def get(ref: str):
            if ref_node(ref) in env:
                return env[ref_node(ref)]
            head, *path = ref.split(".")
            return self.batch.rows(ref, output_of(plan.nodes[head], path).kind, idx)

        for name in plan.update:
            node = plan.nodes[name]
            impl = plan.impl(name)
            if impl.learn is None:
                raise CompileError(f"node {name!r} (op {node.op}) cannot run in the learner update")
            env[name], m = impl.learn(self, node, idx, get, denoms)
            metrics.update({k if "/" in k or k == "entropy" else f"{name}/{k}": v for k, v in m.items()})
        total = sum(w * env[ref_node(r)] for r, w in plan.recipe.losses)
        for r, _ in plan.recipe.losses:
            metrics[f"loss/{ref_node(r)}"] = float(env[ref_node(r)].detach())
        return total, metrics

    def run_updates(self) -> dict[str, float]:
        o, part = self.run.options, self.partition
        n = len(self.batch)
        mini = o.mini_batch_size or n
        micro = self.micro_batching()
        gen = torch.Generator().manual_seed(o.seed + self.run.ctx.step)
        sums: dict[str, float] = {}
        count, grad_norm = 0, 0.0
        t0 = time.perf_counter()
        for _ in range(o.epochs):
            order = torch.randperm(n, generator=gen) if o.shuffle else torch.arange(n)
            for start in range(0, n, mini):
                rows = order[start:start + mini]
                denoms = part.denominators(self, rows)
                micros = part.micro_batches(rows, micro)
                for k, (idx, weight) in enumerate(micros):
                    self.padding = not weight
                    step = partial(self.micro_step, idx, denoms)
                    loss, metrics = part.forward_backward(step, weight=weight, last=k == len(micros) - 1)
                    if weight:
                        self.accumulate(sums, metrics, loss, share=len(idx) / len(rows))
                grad_norm += self.optimizers.step()
                self.updates += 1
                count += 1
        self.padding = False
        self.timings["stage/learner"] = time.perf_counter() - t0
        sums = part.reduce(sums)
        sums["grad_norm"] = grad_norm
        return {k: v / count for k, v in sums.items()} | self.finish_batch_metrics()

    def gather(self, key: str, item: tuple, finish: Callable[[list[tuple]], dict[str, float]]) -> None:
        """Keep ``item`` (e.g. a micro-batch's tensors) under ``key``; after the update loop
        ``finish(items)`` over every process's items (rank order) gives whole-batch metrics."""
        if not self.padding:
            self.scratch.setdefault(key, []).append(item)
            self.finishers[key] = finish

    def finish_batch_metrics(self) -> dict[str, float]:
        out = dict(self.batch_metrics)
        for key, items in self.partition.gather(self.scratch).items():
            out |= self.finishers[key](items)
        return out

    @staticmethod
    def accumulate(sums: dict[str, float], metrics: dict[str, float], loss: Tensor, *, share: float) -> None:
        """Add a micro-step's metrics (weighted by its share of the mini-batch's rows; losses,
        already global-normalised, as they are) and its loss."""
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + v * (share if not k.startswith("loss") else 1.0)
        sums["loss"] = sums.get("loss", 0.0) + float(loss.detach())

    def micro_batching(self) -> MicroBatching:
        """How mini-batches are cut: ``micro_batch_size`` rows, or with ``max_tokens_per_micro_batch``
        by tokens (each row's prompt + completion over every row set the forwards read), keeping
        groups whole when a group-scoped node runs in the update."""
        o = self.run.options
        if o.max_tokens_per_micro_batch is None:
            return MicroBatching(rows=o.micro_batch_size or o.mini_batch_size)
        lengths = sum(sb.lengths.cpu() for _, sb in self.batch.sequence_items())
        whole_groups = any(self.plan.nodes[n].scope == "group" for n in self.plan.update)
        return MicroBatching(rows=o.micro_batch_size, tokens=o.max_tokens_per_micro_batch,
                             lengths=lengths if isinstance(lengths, Tensor) else None,
                             groups=self.batch.group_ids.cpu() if whole_groups else None)

    def denominators(self, rows: Tensor) -> Denominators:
        """Global token and sequence counts of a mini-batch, per completion set."""
        out = {}
        for (_, comps_ref), sb in self.batch.sequence_items():
            m = sb.mask[rows]
            out[comps_ref] = {"tokens": float(m.sum()), "seqs": float((m.sum(-1) > 0).sum())}
        return out

    def counts_for(self, forward: Node, denoms: Denominators) -> dict[str, float]:
        return denoms[self.sequence_refs(forward)[1]]


def _call(fn: Callable[[], T]) -> T:
    return fn()


def _rollout_or_none(value):
    """The Rollout a forward's completions are (None for offline text, e.g. DPO pairs)."""
    return None if isinstance(value, str) else as_rollout(value)


def learner_device(agents) -> torch.device:
    """Where the learner's batch lives: the device of the first trainable agent (the policy), else
    of the first agent, else the CPU."""
    ordered = sorted(agents.values(), key=lambda a: not getattr(a, "trainable", False))
    for agent in ordered:
        device = getattr(agent, "device", None)
        if isinstance(device, torch.device):
            return device
    return torch.device("cpu")


def _episode_means(episodes, prefix: str) -> dict[str, float]:
    """A prepare-stage node's per-episode figures (``ep.metrics`` keys under ``prefix``, e.g. the
    distillation's ``advantages/reverse_kl``) as batch metrics: their mean over the episodes."""
    keys = sorted({k for ep in episodes for k in ep.metrics if k.startswith(prefix)})
    return {k: sum(vals) / len(vals) for k in keys
            for vals in [[ep.metrics[k] for ep in episodes if k in ep.metrics]]}
