"""``@ml.mojo_op``: a user's Mojo kernel as a recipe op.

    @ml.mojo_op(path="kernels/repetition_penalty.mojo")
    def repetition_penalty(completions: torch.Tensor) -> {"penalty_scores": torch.Tensor}:
        '''The body is a declaration; the kernel in ``path`` runs.'''

The kernel is built (and cached) when the recipe is compiled: a missing file or a compile error
fails ``ml.compile`` naming the node, with the Mojo compiler's message. At run time the op sees
its group's values; rollouts/completions are passed as their exact completion token ids. The
calling convention a kernel follows is in ``materl/kernels/fusion.py``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence

from materl.graph.custom import Op, _annotated_outputs


def _as_kernel_arg(x):
    from materl.compiler.values import RolloutBatch

    if isinstance(x, RolloutBatch):
        return [r.completion_ids for r in x]
    return x


def mojo_op(path: str, *, outputs: Sequence[str] | None = None, fn_name: str | None = None,
            scope: str = "group") -> Callable[[Callable], Op]:
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
            result = kernel()(*[_as_kernel_arg(a) for a in ordered])
            return {k: v.float() for k, v in result.items()}

        run.materl_kernel = kernel  # the compiler builds it at compile time
        return Op(run, outputs=outs, scope=scope, kind="mojo", extra={"_mojo": str(path)})

    return decorate
