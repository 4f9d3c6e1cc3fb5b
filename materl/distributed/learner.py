"""A data-parallel learner on torch.distributed: every rank runs this, on its share of the rows.

    init_process_group(rank, world_size, master_addr=..., master_port=...)   # or init_from_env()
    learner = DistributedLearner(agents, options, strategy="fsdp2")         # or "ddp"
    result = learner.step(episodes, ctx)     # the whole batch on every rank; collective
    result.weights                           # rank 0: Weights(version, tensors), else None

One step. Every rank receives the whole batch (the finished episodes and the frozen
``StepContext``) and runs the compiler's ``Learner`` on it with a ``RankPartition``: prepare (the
reference forward, batch-scope nodes) on every row, then, per mini-batch, the rank's contiguous
share of the rows in micro-batches. The loss aggregations get the WHOLE mini-batch's token and
sequence counts as their denominators (each rank has every row, so it counts them itself), so
rank r's loss is its rows' share of the one mini-batch loss: sum_r loss_r = the loss of one
process over every row, and the gradient of the sum is the SUM of the ranks' gradients.

Sums, not means. DDP divides each gradient by the world size and all-reduces (a mean); FSDP2
divides its reduce-scatter by the world size too. Here DDP gets a communication hook that
all-reduces without dividing, and every FSDP2 module a gradient divide factor of 1 with plain-sum
collectives (``set_force_sum_reduction_for_comms``), so the ranks' gradients are summed. (Scaling
the loss by the world size would do the same but would also scale every reported loss.)

In step. Collectives must match across ranks: every rank runs the same number of micro-steps
per mini-batch (a rank with fewer rows runs extra micro-steps on one row with weight 0: zero
gradient, same forward), and gradients are reduced once, on the mini-batch's last micro-step
(DDP ``no_sync``, FSDP2 ``set_requires_gradient_sync``). FSDP2 shards each decoder layer, so
each rank must also run each layer the same number of times per micro-step: the shared-prompt
forward runs the decoder once or twice depending on which rows share prompts, so the FSDP2
learner runs full rows (``share_prompts=False``; the same values up to float summation order).
DDP wraps a whole micro-step as one forward and keeps ``share_prompts`` as compiled.

The update. Gradients are whole (DDP) or sharded (FSDP2); ``clip_grad_norm_`` on FSDP2's DTensor
gradients reduces the norm over the shards, so every rank clips by the global norm, and every
rank's optimizer then applies the same update (to all of it, or to its shard). After the step
rank 0 holds the new trainable weights under the version number (gathered by every rank under
FSDP2), for the driver to publish. Non-frozen reference policies (``reference="ema"``, ...) are
updated on every rank from the whole policy weights, as ``ml.compile`` does.

Devices. gloo on CPU, NCCL on CUDA (``torchrun.backend_for``). The GPU path (NCCL, a CUDA device
mesh, DDP ``device_ids``) is written to torch's documented API but has not been run: the machine
this was built on has no GPU. The compiler's ``Learner`` builds its batch tensors on the CPU, so
a CUDA model also needs those moved (not done here).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeVar

import anyio
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from materl import compute
from materl.compiler.context import StageEnv, StepContext
from materl.compiler.episode import Episode
from materl.compiler.learner import Learner
from materl.compiler.metrics import advantage_turn_metrics, rollout_reader
from materl.compiler.optimizers import Optimizers
from materl.compiler.options import CompileOptions
from materl.compiler.packing import MicroBatching
from materl.compiler.references import reference_pairs, update_references
from materl.distributed import state as st
from materl.distributed.state import LearnerState, Weights
from materl.engines.hf import causal_lm_of
from materl.errors import ConfigError

T = TypeVar("T")
Strategy = Literal["fsdp2", "ddp"]
STRATEGIES: tuple[str, ...] = ("fsdp2", "ddp")
# options the optimizers are built from: a step's context must agree with the learner's
OPTIMIZER_OPTIONS = ("lr", "optimizer", "value_lr", "weight_decay", "betas", "max_grad_norm", "reference",
                     "reference_options")


class RankUpdate:
    """What one learner step returns on a rank: the new version, the metrics (the same on every
    rank: sums over ranks) and, on rank 0, the new weights."""

    def __init__(self, version: int, metrics: dict[str, float], weights: Weights | None):
        self.version, self.metrics, self.weights = version, metrics, weights

    def __repr__(self) -> str:
        return f"RankUpdate(version={self.version}, loss={self.metrics.get('loss')}, weights={self.weights is not None})"


class _Trainable(nn.Module):
    """The trainable agents' models under one root, so one DDP or FSDP2 wrapper covers a policy
    and a value model; its forward runs a function, so whatever the learner computes from the
    models (hidden states, the LM head, the value head) happens inside the root's forward."""

    def __init__(self, models: Mapping[str, nn.Module]):
        super().__init__()
        self.models = nn.ModuleDict(models)

    def forward(self, fn: Callable[[], T]) -> T:
        return fn()


def _sum_hook(group, bucket):  # unannotated: DDP rejects string annotations (this module's __future__ import)
    """DDP communication hook: all-reduce a gradient bucket as a SUM (DDP's default divides)."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


class RankPartition:
    """A rank's part of each mini-batch (``materl.compiler.learner.Partition``)."""

    def __init__(self, module: nn.Module, strategy: Strategy, rank: int, world_size: int):
        self.module, self.strategy, self.rank, self.world_size = module, strategy, rank, world_size

    def micro_batches(self, rows: Tensor, micro: MicroBatching) -> list[tuple[Tensor, float]]:
        """Rank r's share of ``rows`` (``MicroBatching.shard``: contiguous, sizes differ by at most
        one; with a token budget, tokens balanced), in micro-batches; padded with weight-0
        micro-steps to the largest rank's count."""
        shards = micro.shard(rows, self.world_size)
        steps = max(1, max(len(micro.split(s)) for s in shards))
        out = [(idx, 1.0) for idx in micro.split(shards[self.rank])]
        return out + [(rows[:1], 0.0)] * (steps - len(out))

    def denominators(self, learner: Learner, rows: Tensor) -> dict[str, dict[str, float]]:
        return learner.denominators(rows)  # every rank holds every row: these are the global counts

    def forward(self, fn: Callable[[], T]) -> T:
        with torch.no_grad():
            return self.module(fn)

    def forward_backward(self, fn, *, weight: float, last: bool) -> tuple[Tensor, dict]:
        if self.strategy == "ddp":
            sync = contextlib.nullcontext() if last else self.module.no_sync()
        else:
            self.module.set_requires_gradient_sync(last)
            sync = contextlib.nullcontext()
        with sync:
            loss, metrics = self.module(fn)
            (loss * weight if weight != 1.0 else loss).backward()
        return loss, metrics

    def reduce(self, sums: dict[str, float]) -> dict[str, float]:
        every: list[dict[str, float] | None] = [None] * self.world_size
        dist.all_gather_object(every, sums)
        out: dict[str, float] = {}
        for part in every:
            for k, v in (part or {}).items():
                out[k] = out.get(k, 0.0) + v
        return out

    def gather(self, scratch: dict[str, list]) -> dict[str, list]:
        every: list[dict[str, list] | None] = [None] * self.world_size
        dist.all_gather_object(every, scratch)
        out: dict[str, list] = {}
        for part in every:
            for k, items in (part or {}).items():
                out.setdefault(k, []).extend(items)
        return out


class DistributedLearner:
    """One rank of a data-parallel learner; see the module docstring. The process group must be
    initialised (``materl.distributed.torchrun``). ``agents``: this rank's agents by recipe name
    (built the same way on every rank; the trainable ones are wrapped here)."""

    def __init__(self, agents: Mapping[str, Any], options: CompileOptions, *, strategy: Strategy = "fsdp2",
                 device: str | torch.device | None = None):
        if strategy not in STRATEGIES:
            raise ConfigError(f"unknown learner strategy {strategy!r}; valid: {', '.join(STRATEGIES)}")
        if not dist.is_initialized():
            raise ConfigError("DistributedLearner needs an initialised process group: call "
                              "materl.distributed.torchrun.init_process_group(...) or init_from_env() first")
        self.agents, self.options, self.strategy = dict(agents), options, strategy
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.device = torch.device(device) if device is not None else _default_device()
        self.version = 0
        self.trainable = {n: a for n, a in self.agents.items() if a.trainable}
        if not self.trainable:
            raise ConfigError(f"no trainable agent among {', '.join(self.agents) or '(none)'}: nothing to learn")
        self.module = self._wrap()
        self.partition = RankPartition(self.module, strategy, self.rank, self.world_size)
        self.optimizer_set = Optimizers.for_agents(self.trainable, options, clip=_clip)
        self.optimizers = self.optimizer_set.by_agent
        self.references: list | None = None  # (reference agent, source agent, policy), from the first plan

    # -- wrapping --
    def _wrap(self) -> nn.Module:
        for agent in self.agents.values():
            if self.device.type != "cpu":
                agent.to(self.device)
            if agent.trainable and self.options.gradient_checkpointing:
                agent.set_gradient_checkpointing(True)
        root = _Trainable({n: a.model for n, a in self.trainable.items()})
        if self.strategy == "ddp":  # DDP broadcasts rank 0's parameters and buffers here
            ids = [self.device.index] if self.device.type == "cuda" else None
            ddp = DistributedDataParallel(root, device_ids=ids, forward_sync_buffers=False,
                                          find_unused_parameters=True)
            ddp.register_comm_hook(None, _sum_hook)
            return ddp
        with torch.no_grad():  # FSDP2 shards what each rank holds: start every rank from rank 0's weights
            for t in root.state_dict().values():
                dist.broadcast(t, src=0)
        mesh = dist.device_mesh.init_device_mesh(self.device.type, (self.world_size,))
        for model in root.models.values():
            for layer in _decoder_layers(model):
                fully_shard(layer, mesh=mesh)
        fully_shard(root, mesh=mesh)
        for m in root.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)
        return root

    # -- one step --
    def step(self, episodes: list[Episode], ctx: StepContext,
             lrs: Mapping[str, list[float]] | None = None) -> RankUpdate:
        """Learn on ``episodes`` (the whole batch, the same on every rank) as step ``ctx`` says;
        every rank calls this. ``lrs``: each optimizer's learning rate per parameter group for
        this step (an LR schedule run by the driver). Returns the new version; rank 0's result
        carries the weights."""
        self._check(ctx)
        self.set_lrs(lrs or {})
        if self.references is None:
            self.references = reference_pairs(ctx.plan, self.agents, self.options)
        options = ctx.options
        if self.strategy == "fsdp2" and options.share_prompts:
            options = options.model_copy(update={"share_prompts": False})  # see the module docstring
        run = StageEnv(ctx.next(step=self.version, options=options), self.agents)
        learner = Learner(run, [e for e in episodes if e.ok], self.optimizer_set, partition=self.partition)
        t0 = time.perf_counter()
        with compute.serving():  # this thread runs the learner's torch work
            anyio.run(learner.prepare)
            t1 = time.perf_counter()
            turns = advantage_turn_metrics(ctx.plan, learner.episodes, rollout_reader(ctx.plan))
            metrics = learner.run_updates() | turns
        self.version += 1
        t2 = time.perf_counter()
        weights = {n: st.trainable_weights(a.model, keep=self.rank == 0) for n, a in self.trainable.items()}
        self.update_references(metrics.get("policy_loss/kl", metrics.get("kl")))
        metrics.update({"time/prepare": t1 - t0, "time/learner": t2 - t1, "time/gather": time.perf_counter() - t2,
                        "ranks": float(self.world_size), "version": float(self.version)})
        return RankUpdate(self.version, metrics, Weights(self.version, weights) if self.rank == 0 else None)

    def skip(self) -> int:
        """Count a step that made no update (tool infrastructure failures left it nothing to learn
        from; ``FailurePolicy.check_update``): the version advances, the weights and optimizer
        states do not. Returns the new version."""
        self.version += 1
        return self.version

    def set_lrs(self, lrs: Mapping[str, list[float]]) -> None:
        for name, values in lrs.items():
            groups = self.optimizers[name].param_groups if name in self.optimizers else None
            if groups is None or len(values) != len(groups):
                raise ConfigError(f"learning rates {dict(lrs)} do not match this learner's optimizers "
                                  f"{ {n: len(o.param_groups) for n, o in self.optimizers.items()} } (groups per agent)")
            for group, lr in zip(groups, values):
                group["lr"] = lr

    def _check(self, ctx: StepContext) -> None:
        changed = [k for k in OPTIMIZER_OPTIONS if getattr(ctx.options, k) != getattr(self.options, k)]
        if changed:
            raise ConfigError(f"step context options differ from the learner's in {changed}: the learner's "
                              f"optimizers were built from {[getattr(self.options, k) for k in changed]}")
        plan = ctx.plan
        used = {a for n in [*plan.prepare, *plan.update, *plan.live] for a in plan.nodes[n].agents}
        missing = sorted(used - set(self.agents))
        if missing:
            raise ConfigError(f"the step's learner nodes use agents {missing} that this learner rank does not "
                              f"hold; it holds {', '.join(self.agents)}")

    def update_references(self, kl: float | None) -> None:
        """``ml.compile``'s reference update, from the whole policy weights (gathered under FSDP2)."""
        update_references(self.references or (), step=self.version, kl=kl,
                          source=lambda src: (st.full(p).to(self.device) for p in src.model.parameters()))

    # -- checkpoints --
    def state(self) -> LearnerState | None:
        """The full model and optimizer states (collective); rank 0 gets them, the others None.
        The models include the reference agents that follow the policy (``reference="ema"``,
        resets): their weights are state too (whole on every rank)."""
        keep = self.rank == 0
        models = {n: st.full_model_state(a.model, keep=keep) for n, a in self.trainable.items()}
        optims = {n: st.full_optimizer_state(o, keep=keep) for n, o in self.optimizers.items()}
        if not keep:
            return None
        for name in self.followers():
            models[name] = {k: v.detach().cpu().clone() for k, v in self.agents[name].model.state_dict().items()}
        return LearnerState(self.version, models, optims)

    def followers(self) -> list[str]:
        """The names of the reference agents updated from the policy (none under ``"frozen"``)."""
        refs = {id(ref) for ref, _, _ in self.references or ()}
        return [n for n, a in self.agents.items() if id(a) in refs]

    def load_state(self, state: LearnerState) -> None:
        """Every rank loads the same full state (e.g. a checkpoint): weights, optimizer, version."""
        extra = sorted(set(state.models) - set(self.trainable))
        wrong = [n for n in extra if n not in self.agents or self.agents[n].trainable]
        if set(self.trainable) - set(state.models) or wrong or set(state.optimizers) != set(self.trainable):
            raise ConfigError(f"learner state holds models {sorted(state.models)} and optimizers "
                              f"{sorted(state.optimizers)}; this learner trains {sorted(self.trainable)} and "
                              f"holds {sorted(self.agents)}")
        for name, agent in self.trainable.items():
            st.load_model_state(agent.model, state.models[name])
            st.load_optimizer_state(self.optimizers[name], state.optimizers[name])
        for name in extra:  # reference agents that follow the policy: plain modules, whole on every rank
            st.load_model_state(self.agents[name].model, state.models[name])
        self.version = state.version


def _clip(params: list[Tensor], max_norm: float) -> float:
    """``clip_grad_norm_`` over whole (DDP) or sharded (FSDP2: a DTensor norm) gradients."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


def _default_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of an HF causal LM (through LoRA and value-head wrappers): FSDP2's
    units; a model without them is sharded as one unit."""
    try:
        layers = causal_lm_of(model).get_decoder().layers
    except AttributeError:
        return []
    return list(layers)


