"""``ml.compile``: a recipe plus agents and options becomes a runnable training step.

    step = ml.compile(grpo, policy=policy, ref_policy=ref, group_size=4, lr=1e-5)
    print(step.explain())
    metrics = step.run(prompts=["..."], answer=["..."])    # or: await step.arun(...)

``Compiled`` orchestrates: it plans once, and per step builds a frozen ``StepContext``, runs the
rollout stage (``scheduler.rollout_stage``), the failure policy, the learner (``Learner``, which
steps the ``Optimizers`` it is handed, on the step's ``update.LearnerBackend``), the reference policies (``references``) and the engines'
weight sync; rollout metrics are ``metrics.rollout_metrics``. The stages themselves see only a
``StageEnv`` (the context, this process's agents and services), never this object. The recipe's nodes
hold service specs; the step builds the live services once (``services.Services``: judges,
agent endpoints, the recipe's toolboxes), starts them with its first rollout and closes them in
``close()``.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from functools import partial
from typing import Any

import torch

from materl import compute
from materl.agent import Agent
from materl.compiler import graphs
from materl.compiler.context import AgentSpec, Mode, StageEnv, StepContext
from materl.compiler.episode import Episode, make_episodes
from materl.compiler.failures import FailurePolicy
from materl.compiler.loop import LoopThread
from materl.compiler.metrics import episode_rollout, rollout_metrics, rollout_reader
from materl.compiler.optimizers import Optimizers, clip_grad_norm, init_adamw_state  # noqa: F401 (re-exported)
from materl.compiler.options import CompileOptions
from materl.compiler.plan import make_plan
from materl.compiler.references import reference_pairs, update_references
from materl.compiler.scheduler import rollout_stage
from materl.compiler.services import Services
from materl.compiler.services import close as close_services
from materl.compiler.update import InProcessLearner, LearnerBackend, Update
from materl.errors import CompileError
from materl.graph.node import Recipe

log = logging.getLogger("materl")
STOP_WAIT_S = 10.0  # how long an interrupted step may take to unwind before the caller goes on
_ROLLOUTS = itertools.count()  # rollout calls in this process: part of every episode's uid


def compile(recipe: Recipe, **kwargs: Any) -> Compiled:  # noqa: A001 - the public name is ml.compile
    """Validate, prune, order, choose implementations and partition ``recipe`` into stages.
    Keyword arguments that name the recipe's agents bind them; the rest are CompileOptions."""
    if not isinstance(recipe, Recipe):
        raise CompileError(f"ml.compile needs a recipe (from @ml.recipe or @ml.algorithm), got {type(recipe).__name__}")
    agents = {k: v for k, v in kwargs.items() if k in recipe.agents or _is_agent(v)}
    options = CompileOptions.from_kwargs(**{k: v for k, v in kwargs.items() if k not in agents})
    return Compiled(recipe, agents, options)


def _is_agent(x: Any) -> bool:

    return isinstance(x, Agent)


class Compiled:
    def __init__(self, recipe: Recipe, agents: dict, options: CompileOptions, *, rollout_only: bool = False):
        self.recipe = recipe
        self.agents = agents
        self.options = options
        if options.cuda_graphs and not rollout_only:
            graphs.check(agents)  # CompileError without CUDA: never silently eager
        self.plan = make_plan(recipe, agents, options, rollout_only=rollout_only)
        self.step_count = 0
        self.timings: dict[str, float] = {}
        self.last_episodes: list[Episode] = []
        self.last_errors: list[str] = []
        self.failures = FailurePolicy(options.max_failed_fraction, max_skipped_steps=options.max_skipped_steps)
        self.learner: LearnerBackend = InProcessLearner()  # where the updates run (learn_on)
        self._loop = LoopThread(f"materl-loop:{recipe.name}")
        self.services = Services.build(self.plan)  # live objects of the nodes' service specs (not started)
        self._started: list = []  # the services this step started (and closes on close)
        self.optimizer_set = Optimizers.for_agents(agents, options)
        self.optimizers = self.optimizer_set.by_agent  # name -> torch optimizer (checkpoints read these)
        self.references = reference_pairs(self.plan, agents, options)
        if options.gradient_checkpointing and not rollout_only:
            for agent in agents.values():
                if agent.trainable:
                    agent.set_gradient_checkpointing(True)
        torch.manual_seed(options.seed)

    # -- public --
    def explain(self) -> str:
        return self.plan.explain()

    def context(self, mode: Mode = "train") -> StepContext:
        """The frozen, picklable context of the next rollout: plan, options, agent specs, step."""
        return StepContext(self.plan, self.options, {n: AgentSpec.of(a) for n, a in self.agents.items()},
                           step=self.step_count, mode=mode, rollout_id=f"{mode}{next(_ROLLOUTS)}")

    def run(self, prompts: Sequence[Any] | None = None, *, on_episode: Callable[[Episode], None] | None = None,
            **columns: Any) -> dict[str, float]:
        """One training step: rollout, learner, update. Blocking; inside a running event loop use
        ``await arun(...)``. Blocking calls share one background event loop, so tool servers
        started by the first step stay up for the next ones (``close()`` stops them).
        ``on_episode(episode)`` is called as each episode finishes (e.g. a progress bar).
        Returns as soon as the step's last compute work (in this thread) has made its metrics:
        the wake-up of the event loop, whose task then only returns them, is not waited for."""
        answer: Future = Future()
        return self._blocking(self._step, (prompts, on_episode, columns, answer), {}, answer=answer)

    def call_blocking(self, fn, *args, **kwargs):
        """``await fn(*args, **kwargs)`` in the step's event loop, this thread serving its compute work."""
        return self._blocking(fn, args, kwargs)

    def _blocking(self, fn, args: tuple, kwargs: dict, *, answer: Future | None = None):
        """``call_blocking``; with ``answer``, a future ``fn`` sets with its result before it
        returns, the result as soon as that is set."""
        import asyncio

        try:
            asyncio.get_running_loop()
            inside = True
        except RuntimeError:
            inside = False
        if inside:
            name = "arun" if fn == self._step else fn.__name__
            raise CompileError(f"compiled.{name.lstrip('a')}() was called inside an event loop; "
                               f"use `await compiled.{name}(...)`")
        with compute.serving() as here:  # this thread decodes and learns while the loop runs the step
            future = self._loop.submit(fn, *args, **kwargs)
            if answer is not None:
                future.add_done_callback(partial(_settle, answer))
            try:
                return here.until(answer if answer is not None else future)
            except BaseException:  # Ctrl-C or a signal (materl.runtime.signals) while the step runs
                if not future.done():
                    self._stop(future, here)
                raise

    def _stop(self, future, here) -> None:
        """Cancel the step behind ``future`` and serve its compute work while it unwinds (its
        ``finally`` blocks run, its tasks end); give up after ``STOP_WAIT_S``: the caller is
        stopping anyway, and ``close()`` still stops the tool servers."""
        self._loop.cancel(future)
        try:
            here.until(future, timeout_s=STOP_WAIT_S)
        except Exception:  # noqa: BLE001 - CancelledError, or what the step raised while unwinding
            pass

    def close(self) -> None:
        """Close the services this step started (tool servers, agent endpoints, judges' connection
        pools) and the background event loop. The recipe's toolboxes stay usable: another compiled
        step (or this one, on its next run) starts them again."""
        if self._loop.running:
            self._loop.call(self.aclose)
        self._loop.close()

    async def aclose(self) -> None:
        started, self._started = self._started, []
        await close_services(started)

    async def start_services(self) -> Services:
        """Start the plan's services that are not running (``materl.compiler.services``)."""
        self._started += await self.services.start()
        return self.services

    def service(self, node: str, param: str | None = None) -> Any:
        """The live service this step built from node ``node``'s spec (``param``: which, when it
        holds several): its Judge, AgentEndpoint, PrincipleJudge or Toolbox."""
        return self.services.of(node, param)

    async def arun(self, prompts: Sequence[Any] | None = None, *,
                   on_episode: Callable[[Episode], None] | None = None, **columns: Any) -> dict[str, float]:
        return await self._step(prompts, on_episode, columns)

    async def _step(self, prompts, on_episode, columns: dict, answer: Future | None = None) -> dict[str, float]:
        self.timings = {}
        t0 = time.perf_counter()
        episodes = await self.rollout(prompts, on_episode=on_episode, **columns)
        return await self.learn(episodes, started=t0, answer=answer)

    async def rollout(self, prompts: Sequence[Any] | None = None, *, group_size: int | None = None,
                      greedy: bool = False, on_episode: Callable[[Episode], None] | None = None,
                      **columns: Any) -> list[Episode]:
        """Run the rollout stage only (evaluation uses this with ``greedy=True``)."""
        services = await self.start_services()
        ctx = self.context("eval" if greedy else "train")
        episodes = make_episodes(ctx, prompts, columns, group_size or self.options.group_size)
        self.timings["stage/rollout"] = await rollout_stage(StageEnv(ctx, self.agents, services), episodes,
                                                            on_episode=on_episode)
        return episodes

    async def learn(self, episodes: list[Episode], *, rollout_s: float | None = None, started: float | None = None,
                    answer: Future | None = None) -> dict[str, float]:
        """The learner stage on finished episodes (``rollout_s``: how long their rollout took,
        reported as ``time/rollout``): failure policy, the update on this step's learner backend
        (``learn_on``), then ``finish`` (weight sync, references, metrics) in the compute thread. A
        step that tool infrastructure failures left nothing to learn from is ``skip``ped.
        ``started``: when the step began (``perf_counter``; the metrics get ``time/step`` and
        ``tokens_per_s``); ``answer``: a future set with the metrics once they are made (``run``)."""
        if rollout_s is not None:  # a pipeline's step: the rollout ran elsewhere
            self.timings = {"stage/rollout": rollout_s}
        metrics, update = self.assess(episodes)
        if not update:
            await self.learner.skip(self)
            metrics = self.skip(episodes, metrics | {f"time/{k}": v for k, v in self.timings.items()})
            return _answered(metrics, started, answer)
        ok = [e for e in episodes if e.ok]
        self.last_episodes = ok
        return await self.learner.update(self, ok, then=partial(self.finish, metrics, started=started, answer=answer))

    def finish(self, metrics: dict[str, float], done: Update, *, started: float | None = None,
               answer: Future | None = None) -> dict[str, float]:
        """The end of a step that made update ``done`` (compute thread, right after it): the step
        count and the trainable agents' policy version, their engines' weights, the reference
        policies that follow, and the step's metrics (``metrics``: its rollout's, completed here)."""
        self.timings.update(done.timings)
        self.step_count = done.version
        for agent in {id(a): a for a in self.agents.values()}.values():
            if agent.trainable:
                agent.sync_engine()  # in-process: drops stale copies; SGLang: pushes the new weights
                agent.policy_version = self.step_count
        if self.references:  # a reference that follows the policy (not "frozen", the default)
            self.update_references(done.metrics.get("policy_loss/kl", done.metrics.get("kl")))
        metrics.update(done.metrics)
        metrics.update({f"time/{k}": v for k, v in self.timings.items()})
        metrics["step"] = self.step_count
        return _answered(metrics, started, answer)

    def learn_on(self, backend: LearnerBackend | None) -> None:
        """Run the updates of the next steps on ``backend`` (e.g. ``distributed.ranks.RankedLearner``);
        None: in this process again."""
        self.learner = backend if backend is not None else InProcessLearner()

    def restore(self, step: int) -> None:
        """Continue from a checkpoint of step ``step`` (its weights and optimizer states already
        loaded): the step count and the trainable agents' policy version."""
        self.step_count = int(step)
        for agent in self.agents.values():
            if agent.trainable:
                agent.policy_version = self.step_count

    def assess(self, episodes: list[Episode]) -> tuple[dict[str, float], bool]:
        """A finished batch's rollout and failure metrics, and whether it makes an update: the
        failure policy raises ``StepFailedError`` for a step that failed too much, and says False
        for one that tool infrastructure failures left nothing to learn from (``check_update``);
        ``infra_failures/update_skipped`` is 1 for that step, 0 for the others."""
        metrics = self.rollout_metrics(episodes)
        metrics.update(self.failures.metrics(episodes))
        self.failures.check(episodes, step=self.step_count + 1)
        update = self.failures.check_update(episodes, step=self.step_count + 1)
        metrics["infra_failures/update_skipped"] = float(not update)
        return metrics, update

    def skip(self, episodes: list[Episode], metrics: dict[str, float]) -> dict[str, float]:
        """A step without an update, counted like any other: the step count (and with it the
        policy version, so an asynchronous pipeline goes on) advances; weights, optimizer states
        and references stay as they are. ``last_episodes`` are the ones that ran (their samples
        show the outage)."""
        self.last_episodes = [e for e in episodes if e.error is None]
        self.step_count += 1
        for agent in {id(a): a for a in self.agents.values()}.values():
            if agent.trainable:
                agent.policy_version = self.step_count  # the same weights under the step's version
        metrics["step"] = self.step_count
        return metrics

    # -- pieces --
    @property
    def episodes_per_prompt(self) -> int:
        """group_size for recipes that generate; 1 for offline ones (DPO pairs)."""
        return self.options.group_size if self.plan.generates() else 1

    def rollout_metrics(self, episodes: list[Episode]) -> dict[str, float]:
        self.last_errors = [str(e.error) for e in episodes if e.error]
        return rollout_metrics(self.plan, episodes, rollout_reader(self.plan), self.timings)

    def episode_rollout(self, ep: Episode):
        """The episode's rollout: the value of its last rollout-producing node (None if it has none)."""
        return episode_rollout(self.plan, ep)

    def optimizer_step(self) -> float:
        """Clip, step and zero every optimizer; the largest gradient norm (``Optimizers.step``)."""
        return self.optimizer_set.step()

    def update_references(self, kl: float | None) -> None:
        update_references(self.references, step=self.step_count, kl=kl)

    def __repr__(self) -> str:
        return f"<compiled {self.recipe.name}: {len(self.plan.order)} nodes, agents {', '.join(self.agents)}>"


def _answered(metrics: dict[str, float], started: float | None, answer: Future | None) -> dict[str, float]:
    """A step's finished ``metrics``, with its time and throughput when it ``started`` then; set
    into ``answer`` too."""
    if started is not None:
        metrics["time/step"] = time.perf_counter() - started
        metrics["tokens_per_s"] = metrics["tokens"] / metrics["time/step"]
    if answer is not None:
        answer.set_result(metrics)
    return metrics


def _settle(answer: Future, task: Future) -> None:
    """The step's task ended: its outcome is the answer if the step did not set one (it raised,
    or was cancelled). An error after the answer was set cannot be returned to anyone: log it."""
    if answer.done():
        if not task.cancelled() and task.exception() is not None:
            log.error("materl: the step's event-loop task failed after its metrics were returned", exc_info=task.exception())
        return
    if task.cancelled():
        answer.cancel()
    elif task.exception() is not None:
        answer.set_exception(task.exception())
    else:
        answer.set_result(task.result())


__all__ = ["compile", "Compiled"]
