"""Which exceptions an agent raises because of what the model did (``ml.agent_episodes(model_errors=...)``).

An agent framework raises when the model misbehaves: it called a tool that does not exist, wrote
arguments that are not JSON, never stopped calling tools, refused. That is the model's mistake,
and an episode that ends in it is scored like any other (its rewards see no result, e.g. 0), so
the update pushes the model away from what it did. Other exceptions (the agent's own bug, a
network error) are not the model's doing: they fail the episode, which is left out of the update.

``MODEL_ERRORS`` names the model-behaviour errors of common frameworks by qualified name, so
none of them has to be installed; an exception counts when its class or a base class is named
(or is given as a class). An exception group counts when every exception in it does.
"""

from __future__ import annotations

from collections.abc import Sequence

from materl.errors import RecipeError

MODEL_ERRORS: tuple[str, ...] = (
    "agents.exceptions.ModelBehaviorError",  # OpenAI Agents SDK: unknown tool, arguments not JSON, ...
    "agents.exceptions.MaxTurnsExceeded",  # OpenAI Agents SDK: the model never gave a final answer
    "agents.exceptions.ModelRefusalError",  # OpenAI Agents SDK: the model refused
    "pydantic_ai.exceptions.UnexpectedModelBehavior",  # Pydantic AI: output retries used up, unknown tool
    "langchain_core.exceptions.OutputParserException",  # LangChain: the model's output did not parse
    "langgraph.errors.GraphRecursionError",  # LangGraph: the recursion (turn) limit was reached
)


def check_model_errors(kinds, where: str) -> tuple:
    """``kinds`` as a tuple of exception classes and qualified names; ``RecipeError`` otherwise."""
    if isinstance(kinds, (str, type)) or not isinstance(kinds, Sequence):
        raise RecipeError(f"{where}(model_errors=...) takes a list of exception classes or qualified names "
                          f"('module.ClassName'), got {kinds!r}")
    for k in kinds:
        ok = (isinstance(k, type) and issubclass(k, BaseException)) or (isinstance(k, str) and "." in k)
        if not ok:
            raise RecipeError(f"{where}(model_errors=...): {k!r} is neither an exception class nor a qualified "
                              f"name such as 'agents.exceptions.ModelBehaviorError'")
    return tuple(kinds)


def is_model_error(exc: BaseException, kinds: Sequence[type | str]) -> bool:
    """Whether ``exc`` is one of ``kinds`` (module docstring)."""
    if isinstance(exc, BaseExceptionGroup):
        return all(is_model_error(e, kinds) for e in exc.exceptions)
    classes = tuple(k for k in kinds if isinstance(k, type))
    names = {k for k in kinds if isinstance(k, str)}
    return isinstance(exc, classes) or any(f"{c.__module__}.{c.__qualname__}" in names for c in type(exc).__mro__)


def describe(exc: BaseException) -> str:
    """``Type: message`` (the first of a group's)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"
