"""The op table: one ``OpSpec`` per op kind, the only place that says what a kind is.

    OPS.get("advantages").role            # Role.SCORE
    OPS.get("advantages").output("returns")  # Output("returns", PER_TOKEN)
    impl, notes = OPS.get("policy_loss").choose(node, options)   # the implementation that runs

A spec holds the kind's role (how the planner and stages treat it), its named outputs with their
shapes (``%advantages.returns`` reads a named output; a group or batch result must have one row
per episode, checked when it is split), its
implementations in order of preference with the rule that admits each (data, in the spirit of
autodidax's impl rules: ops never decide where they run), its locality (whether a batch call
over several episodes equals one call per episode, so the scheduler may batch them), its
compile-time checks, the params that hold services (``services``: a Toolbox, an endpoint's or a
judge's spec, which the compiled step builds, starts and closes: ``materl.compiler.services``),
and the facts other code asks about a kind instead of comparing its name
(``turn``, ``may_call_tools``, ``teacher_input``, ``resolve``; the graph layer's facts, from
``materl.graph.kinds``, are ``spec.facts``). Adding an op kind is one module in
``materl.compiler.kinds`` with its spec, one entry in ``kinds.SPECS``, and a test.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from materl.compiler.options import CompileOptions
from materl.errors import CompileError
from materl.graph.kinds import KindFacts, facts_of
from materl.graph.node import Node
from materl.registry import Registry


class Role(enum.Enum):
    DATA = "data"  # a recipe input: one dataset row per episode
    ROLLOUT = "rollout"  # produces the episode's tokens (generate, generate_step, structure_rollout, env_rollout)
    TOOLS = "tools"  # runs tool calls between model turns
    SCORE = "score"  # rewards, advantages, filters: numbers about finished rollouts
    FORWARD = "forward"  # a model forward over (prompt, completion) in the learner
    LOSS = "loss"  # a loss term, minimised by the learner
    CUSTOM = "custom"  # a user's @ml.op


class Kind(enum.Enum):
    """What one episode's value of an output is."""

    ROLLOUT = "rollout"  # a Rollout (or an EpisodeState / TurnResult holding one)
    ROW = "row"  # one number per episode
    TOKENS = "tokens"  # one number per completion token: a 1-D tensor as long as the completion
    SCORE = "score"  # ROW or TOKENS (rewards: token-level when any term is)
    FLAG = "flag"  # a bool per episode (kept or filtered)
    OBJECT = "object"  # anything (tool results, a custom op's value)


@dataclass(frozen=True)
class Output:
    name: str
    kind: Kind


@dataclass(frozen=True)
class Impl:
    """One way to run an op kind.

    ``episode(run, node, ep, *inputs)``: one episode; may be async (returns its value or an
    awaitable of it). ``batch(run, node, eps, inputs)``:
    several episodes at once, ``inputs`` holding per input the list of per-episode values; may be
    async. Learner stage: ``prepare(learner, node)`` gives a forward's no-gradient (B, T) value
    once per batch; ``learn(learner, node, rows, get, denoms)`` gives ``(value, metrics)`` for
    the micro-batch ``rows`` with gradient (forwards, losses, batch-scope custom ops). ``when(node,
    options)``: None if this implementation can run the node, else why not. ``kernel``: a Mojo
    implementation (skipped with ``kernels="torch"``; required with ``kernels="mojo"`` when its
    ``when`` says the node is one it is for, i.e. anything but ``NOT_FOR``).
    """

    name: str
    episode: Callable | None = None
    batch: Callable | None = None
    prepare: Callable | None = None
    learn: Callable | None = None
    when: Callable[[Node, CompileOptions], str | None] = lambda node, options: None
    kernel: bool = False
    # ``direct(node)``: a function of the node's episode inputs alone (positional) that does what
    # ``episode`` does for that node, returning its value or an awaitable; None where there is none.
    # The scheduler then calls it instead of ``episode`` (no wrapper call per node per episode).
    direct: Callable[[Node], Callable | None] | None = None


NOT_FOR = "not for this node"  # a ``when`` reason: the implementation does not apply (never an error)


@dataclass(frozen=True)
class OpSpec:
    kind: str
    role: Role
    outputs: tuple[Output, ...]
    impls: tuple[Impl, ...]
    locality: str | Callable[[Node], str] = "row"  # "row", "group" or "batch"
    check: Callable[[Node, Any], Sequence[str]] = lambda node, recipe_info: ()  # wiring problems
    agent_check: Callable[[Node, Any], str | None] = lambda node, agent: None  # e.g. "needs a value head"
    always_runs: bool = False  # kept when no loss reads it (filters act by dropping episodes)
    without_reference: Callable[[Node], Node] | None = None  # the node when reference="none"
    describe: Callable[[Node, str], str] | None = None  # an extra line for explain() (impl name given)
    # choices the node leaves to compile time, filled from the options and the recipe's defaults
    resolve: Callable[[Node, CompileOptions, Mapping[str, Any]], Node] | None = None
    turn: bool = False  # its value is one model turn: call_tools runs its calls, a step reward lands on it
    may_call_tools: Callable[[Node], bool] = lambda node: False  # its episodes may call tools (tool metrics)
    teacher_input: int | None = None  # the input holding a teacher's log-probs (that agent never follows the policy)
    # the params that may hold a service's spec (materl.rollout.services.ServiceSpec): the compiled step
    # builds the live service from it, starts it and closes it; the implementations read it from StageEnv.service
    services: tuple[str, ...] = ()
    doc: str = ""

    @property
    def facts(self) -> KindFacts:
        """What the graph layer knows about this kind (``materl.graph.kinds``)."""
        return facts_of(self.kind)

    def output(self, name: str | None = None) -> Output:
        """The named output, or the default (first) one."""
        if name is None:
            return self.outputs[0]
        for out in self.outputs:
            if out.name == name:
                return out
        raise CompileError(f"op {self.kind!r} has no output {name!r}; outputs: {', '.join(o.name for o in self.outputs)}")

    def locality_of(self, node: Node) -> str:
        return self.locality(node) if callable(self.locality) else self.locality

    def choose(self, node: Node, options: CompileOptions) -> tuple[Impl, str]:
        """The first implementation whose rule admits ``node`` (Mojo ones unless
        ``kernels="torch"``), and a note on a Mojo implementation passed over ('' if none)."""
        note = ""
        tried = []
        for impl in self.impls:
            if impl.kernel and options.kernels == "torch":
                continue
            why = impl.when(node, options)
            if why is None:
                return impl, note
            if why != NOT_FOR:
                tried.append(f"{impl.name}: {why}")
            if impl.kernel and why != NOT_FOR:
                if options.kernels == "mojo":
                    raise CompileError(f"node {node.name!r}: kernels='mojo' but the Mojo {self.kind} cannot run it: "
                                       f"{why}")
                note = f"mojo unavailable: {why}"
        if len(tried) == 1:  # the only implementation for this node says why it cannot run
            raise CompileError(f"node {node.name!r} (op {self.kind}): {tried[0].split(': ', 1)[1]}")
        raise CompileError(f"node {node.name!r} (op {self.kind}): no implementation can run it"
                           + (f" ({'; '.join(tried)})" if tried else ""))


OPS: Registry[OpSpec] = Registry("op kind")


def spec_of(node: Node) -> OpSpec:
    return OPS.get(node.op)


def may_be_turn(node: Node) -> bool:
    """Whether ``node``'s value may be one model turn: a turn kind (``OpSpec.turn``), or a user's op,
    which may return one (what ``call_tools`` and a reward's ``step=`` read)."""
    spec = spec_of(node)
    return spec.turn or spec.role is Role.CUSTOM


def output_of(node: Node, path: Sequence[str] = ()) -> Output:
    """The output a reference ``node.path`` reads: a named output, or the default one."""
    spec = spec_of(node)
    names = {o.name for o in spec.outputs}
    return spec.output(path[0] if path and path[0] in names else None)


@dataclass(frozen=True)
class RecipeInfo:
    """What a spec's compile-time ``check`` may look at besides its node."""

    nodes: Mapping[str, Node]
    agents: Mapping[str, Any] = field(default_factory=dict)
    options: Any = None  # the CompileOptions the recipe is compiled with (None: not known)

    def producer(self, ref: str) -> Node | None:
        return self.nodes.get(ref.split(".", 1)[0])
