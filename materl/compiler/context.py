"""What a stage needs to run, split into what can travel and what cannot.

``StepContext`` is frozen and picklable: the plan (nodes, order, stages, the implementation of
each node), the compile options, a description of each agent, the step number and the mode.
``StageEnv`` pairs it with what one process holds: its agents (models, tokenizers, engines) and the
live services it built from the plan's specs and started (``materl.compiler.services``: tool
servers, agent endpoints, judges). The rollout stage runs from a ``StageEnv`` alone, so a worker
process that builds its own engine and services can run episodes from a context it was sent.

    ctx = StepContext(plan, options, agents={"policy": AgentSpec.of(policy)}, step=3)
    await rollout_stage(StageEnv(ctx, {"policy": policy}), episodes)       # a plan without services
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from materl.agent import Agent
from materl.compiler.options import CompileOptions
from materl.compiler.services import Services
from materl.engines.base import SamplingParams
from materl.errors import UnknownNameError
from materl.graph.node import Node

Mode = Literal["train", "eval"]


@dataclass(frozen=True)
class AgentSpec:
    """How to build an agent in another process: the model, trainable or not, head, LoRA, engine."""
    name: str
    source: str | None  # a named model or folder; None for an agent built from a module object
    trainable: bool
    head: str | None
    lora: tuple[tuple[str, Any], ...] | None
    engine: str
    engine_options: tuple[tuple[str, Any], ...] = ()

    def build(self):
        """A fresh ``ml.Agent`` like the one described (its weights load when first used)."""
        if self.source is None:
            raise ValueError(f"agent {self.name!r} was built from a module object; another process cannot rebuild it")
        return Agent(self.source, trainable=self.trainable, engine=self.engine, head=self.head,
                     lora=dict(self.lora) if self.lora else None, engine_options=dict(self.engine_options),
                     name=self.name)

    @classmethod
    def of(cls, agent: Any) -> AgentSpec:
        lora = tuple(sorted(agent.lora.items())) if agent.lora else None
        return cls(agent.name, agent.source, agent.trainable, agent.head, lora, agent.engine_name,
                   tuple(sorted(agent.engine_options.items())))


@dataclass(frozen=True)
class StepContext:
    plan: Any  # materl.compiler.plan.Plan
    options: CompileOptions
    agents: Mapping[str, AgentSpec] = field(default_factory=dict)
    step: int = 0  # the policy version the step's rollouts sample from (updates done so far)
    mode: Mode = "train"  # "eval": greedy decoding, no learner
    rollout_id: str = ""  # unique per rollout call: part of each episode's uid

    @property
    def greedy(self) -> bool:
        return self.mode == "eval"

    def next(self, **changes: Any) -> StepContext:
        return replace(self, **changes)


@dataclass(frozen=True)
class StageEnv:
    """A step context plus this process's agents and started services (never pickled)."""
    ctx: StepContext
    agents: Mapping[str, Any]
    services: Services = field(default_factory=Services)

    @property
    def options(self) -> CompileOptions:
        return self.ctx.options

    @property
    def plan(self):
        return self.ctx.plan

    def agent(self, node: Node) -> Any:
        """The agent a node names first (``@policy``)."""
        return self.agents[node.agents[0]]

    def service(self, node: Node, param: str) -> Any:
        """The live service built from ``node.params[param]`` (``OpSpec.services``)."""
        service = self.services.get(node.name, param)
        if service is None:
            raise UnknownNameError(f"node {node.name!r} ({node.op}) has no live {param!r} service in this StageEnv; the "
                                   f"compiled step and rollout_from_context build them from the plan "
                                   f"(StageEnv(ctx, agents, Services.build(plan)), started)")
        return service


def sampling(run: StageEnv, node: Node, seed: int, turn: int = 0) -> SamplingParams:
    """The sampling parameters of ``node`` for an episode's ``turn``: the node's own, else the
    compile options'; greedy in evaluation; a seed per (episode, turn)."""
    o, p = run.options, node.params
    return SamplingParams(
        max_new_tokens=p.get("max_new_tokens", o.max_new_tokens), temperature=p.get("temperature", o.temperature),
        top_p=p.get("top_p", o.top_p), top_k=p.get("top_k", o.top_k), stop_strings=tuple(p.get("stop") or ()),
        greedy=run.ctx.greedy or bool(p.get("greedy", False)), seed=(seed * 1009 + turn * 7919) % (2**63 - 1),
    )
