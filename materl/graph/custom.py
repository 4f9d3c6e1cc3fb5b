"""``@ml.op`` and ``@ml.mojo_op``: a user's Python function (sync or async), or a user's Mojo
kernel, as a graph node.

    @ml.op
    def sentiment_reward(completions_text: list[str]) -> {"rewards": torch.Tensor}: ...

    @ml.mojo_op(path="kernels/repetition_penalty.mojo")
    def repetition_penalty(completions: torch.Tensor) -> {"penalty_scores": torch.Tensor}:
        '''The body is a declaration; the kernel in ``path`` runs.'''

Outputs come from the return annotation (a dict of names) or ``outputs=``. Scope: async ops run
per episode by default (one call per episode, e.g. a tool call); sync ops per group (they get the
group's values as lists/tensors) unless ``scope=`` says otherwise; a node never runs before its
inputs exist, so the scope is raised to the latest input's scope. Called outside a recipe, an op
is just the function.

A Mojo op's kernel is built (and cached) when the recipe is compiled: a missing file or a
compile error fails ``ml.compile`` naming the node, with the Mojo compiler's message. At run
time it sees its group's values, rollouts as their exact completion token ids (the compiler
converts them); the calling convention a kernel follows is in ``materl/kernels/fusion.py``.
"""

from __future__ import annotations

import ast
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from materl.errors import RecipeError
from materl.graph.node import SCOPES
from materl.graph.trace import _BUILDER, RewardExpr, Value


class Op:
    def __init__(self, fn: Callable, *, outputs: tuple[str, ...] | None = None, scope: str | None = None,
                 kind: str = "python", extra: dict | None = None):
        self.fn = fn
        self.is_async = inspect.iscoroutinefunction(fn)
        self.outputs = tuple(outputs) if outputs is not None else _annotated_outputs(fn)
        self.scope = scope or ("episode" if self.is_async else "group")
        if self.scope not in SCOPES:
            raise RecipeError(f"op {fn.__name__!r}: scope must be one of {', '.join(SCOPES)}, got {scope!r}")
        self.kind = kind
        self.extra = dict(extra or {})
        self.signature = inspect.signature(fn)
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        builder = _BUILDER.get()
        if builder is None:
            return self.fn(*args, **kwargs)
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise RecipeError(f"op {self.fn.__name__!r} called with the wrong arguments: {e}; "
                              f"signature: {self.fn.__name__}{self.signature}") from None
        inputs, argnames, consts = [], [], {}
        for pname, v in bound.arguments.items():
            if isinstance(v, (Value, RewardExpr)):
                inputs.append(v)
                argnames.append(pname)
            else:
                consts[pname] = v
        params: dict[str, Any] = {"fn": self.fn, "_args": tuple(argnames), "_consts": consts, **self.extra}
        value = builder.add("call", inputs, params, scope=self.scope, name=None,
                            default_name=self.fn.__name__, outputs=self.outputs)
        return getattr(value, self.outputs[0]) if len(self.outputs) == 1 else value

    def __repr__(self) -> str:
        return f"<ml.op {self.fn.__name__} -> {list(self.outputs) or 'value'} [{self.scope}]>"


def op(fn: Callable | None = None, *, outputs: list[str] | tuple[str, ...] | None = None,
       scope: str | None = None):
    """Decorator: ``@ml.op`` or ``@ml.op(outputs=[...], scope="batch")``."""
    if fn is not None:
        return Op(fn, outputs=outputs, scope=scope)
    return lambda f: Op(f, outputs=outputs, scope=scope)


def _annotated_outputs(fn: Callable) -> tuple[str, ...]:
    """Output names from ``-> {"a": T, "b": U}``; read by parsing, never evaluating, annotations."""
    ann = inspect.signature(fn).return_annotation
    if ann is inspect.Signature.empty:
        return ()
    if isinstance(ann, dict):
        return tuple(str(k) for k in ann)
    if isinstance(ann, str):
        try:
            tree = ast.parse(ann, mode="eval").body
        except SyntaxError:
            return ()
        if isinstance(tree, ast.Dict):
            keys = [k.value for k in tree.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
            if len(keys) == len(tree.keys):
                return tuple(keys)
    return ()


def mojo_op(path: str, *, outputs: Sequence[str] | None = None, fn_name: str | None = None,
            scope: str = "group") -> Callable[[Callable], Op]:
    """Decorator: the Mojo kernel ``fn_name`` (default: the function's name) in ``path`` as an op
    with the decorated function's signature and outputs."""

    def decorate(fn: Callable) -> Op:
        name = fn_name or fn.__name__
        outs = tuple(outputs) if outputs is not None else _annotated_outputs(fn)

        @functools.lru_cache(maxsize=1)
        def kernel():
            from materl.kernels.fusion import load_user_kernel

            return load_user_kernel(path, name, list(outs))

        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def run(*args, **kwargs):
            ordered = signature.bind(*args, **kwargs).arguments.values()  # the kernel takes them in order
            return {k: v.float() for k, v in kernel()(*ordered).items()}

        run.materl_kernel = kernel  # the compiler builds it at compile time
        return Op(run, outputs=outs, scope=scope, kind="mojo", extra={"_mojo": str(path)})

    return decorate
