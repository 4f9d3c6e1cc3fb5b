"""``@ml.op`` nodes: a user's Python function (sync or async), or a user's Mojo kernel
(``@ml.mojo_op``), called per episode, per group, or in the learner."""

from __future__ import annotations

from collections.abc import Callable
from types import FunctionType
from typing import Any

from materl.compiler.context import StageEnv
from materl.compiler.episode import Episode, as_rollout, collate
from materl.compiler.spec import NOT_FOR, Impl, Kind, OpSpec, Output, Role
from materl.errors import CompileError, EpisodeError
from materl.graph.node import Node
from materl.rollout.multiturn import TurnResult
from materl.rollout.types import Rollout


def _args(node: Node, inputs: list | tuple) -> dict[str, Any]:
    args = dict(zip(node.params["_args"], inputs))
    consts = node.params["_consts"]
    return {**consts, **args} if consts else args


def _name(node: Node) -> str:
    return node.params["fn"].__name__


def call_episode(run: StageEnv, node: Node, ep: Episode, *inputs):
    """The op's value, or for an async op an awaitable of it: the op's own coroutine when it
    declares no outputs to check (no wrapper coroutine per node per episode)."""
    out = node.params["fn"](**_args(node, inputs))
    if hasattr(out, "__await__"):
        return _checked(node, out) if node.outputs else out
    return _check_outputs(node, out)


async def _checked(node: Node, out):
    return _check_outputs(node, await out)


def direct_episode(node: Node) -> Callable | None:
    """The op's own function, when calling it with the node's inputs positionally binds them as
    ``call_episode``'s keywords do and its value needs no check: a plain Python function whose
    first parameters (none positional-only) are the inputs in order, no constants, no declared
    outputs. ``Impl.direct`` of the Python implementation."""
    fn = node.params["fn"]
    if node.outputs or node.params["_consts"] or type(fn) is not FunctionType:
        return None
    code, names = fn.__code__, tuple(node.params["_args"])
    if code.co_posonlyargcount or len(names) > code.co_argcount or code.co_varnames[:len(names)] != names:
        return None
    return fn


def call_group(run: StageEnv, node: Node, eps: list[Episode], inputs: list[list]):
    out = node.params["fn"](**_args(node, [collate(v) for v in inputs]))
    if hasattr(out, "__await__"):
        out.close()
        raise CompileError(f"op {_name(node)!r} is async; async ops run per episode (scope='episode')")
    return _check_outputs(node, out)


def call_kernel_group(run: StageEnv, node: Node, eps: list[Episode], inputs: list[list]):
    """A user Mojo kernel gets rollouts as lists of their exact completion token ids."""
    args = [[as_rollout(x).completion_ids for x in v] if v and isinstance(v[0], (Rollout, TurnResult))
            else collate(v) for v in inputs]
    return _check_outputs(node, node.params["fn"](**_args(node, args)))


async def call_kernel_episode(run: StageEnv, node: Node, ep: Episode, *inputs):
    return _check_outputs(node, node.params["fn"](**_args(node, [_ids(x) for x in inputs])))


def _ids(x: Any) -> Any:
    return as_rollout(x).completion_ids if isinstance(x, (Rollout, TurnResult)) else x


def call_learn(learner, node: Node, rows, get, denoms):
    return node.params["fn"](**_args(node, [get(r) for r in node.inputs if not r.startswith("@")])), {}


def _check_outputs(node: Node, out):
    if node.outputs:
        if not isinstance(out, dict) or set(node.outputs) - set(out):
            got = sorted(out) if isinstance(out, dict) else type(out).__name__
            raise EpisodeError(f"op {_name(node)!r} must return a dict with {list(node.outputs)}; got {got}")
    return out


def _python(node: Node, options) -> str | None:
    return NOT_FOR if "_mojo" in node.params else None


def _user_kernel(node: Node, options) -> str | None:
    if "_mojo" not in node.params:
        return NOT_FOR
    try:
        node.params["fn"].materl_kernel()  # built (and cached) now, at compile time
    except Exception as e:  # noqa: BLE001 - reported as the compile error
        return f"Mojo kernel {node.params['_mojo']!r} failed to load: {e}"
    return None


def _locality(node: Node) -> str:
    return {"episode": "episode", "group": "group_call", "batch": "batch"}[node.scope]


SPECS = (
    OpSpec("call", Role.CUSTOM, (Output("value", Kind.OBJECT),), (
        Impl("python", episode=call_episode, batch=call_group, learn=call_learn, when=_python,
             direct=direct_episode),
        Impl("mojo (user kernel)", episode=call_kernel_episode, batch=call_kernel_group, learn=call_learn,
             when=_user_kernel),
    ), locality=_locality, doc="a user's @ml.op / @ml.mojo_op function"),
)
