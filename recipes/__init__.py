"""Built-in recipes, one algorithm per file.

    materl.recipes.names()                      # every built-in name a config or `materl recipes` accepts
    materl.recipes.get("grpo")                  # a Recipe
    materl.recipes.build("grpo_tools", toolbox) # recipes whose graph holds a Toolbox are built from one

Most recipes are plain ``Recipe`` values. A few take the run's tools, because the tools are part
of the graph (their schemas enter the chat template): those are factories ``f(toolbox) -> Recipe``
(``grpo_tools_recipe``); ``build`` calls them, with the shipped calculator server by default.
"""

from materl.recipes.dapo import dapo
from materl.recipes.distill import distill
from materl.recipes.dpo import dpo
from materl.recipes.dr_grpo import dr_grpo
from materl.recipes.grpo import grpo
from materl.recipes.grpo_tools import grpo_tools_recipe
from materl.recipes.gspo import gspo
from materl.recipes.ppo import ppo
from materl.recipes.reinforce_pp import reinforce_pp
from materl.recipes.remax import remax
from materl.recipes.rloo import rloo
from materl.recipes.vapo import vapo

RECIPES = {r.name: r for r in (grpo, dr_grpo, dapo, gspo, rloo, reinforce_pp, remax, ppo, vapo, dpo, distill)}
FACTORIES = {"grpo_tools": grpo_tools_recipe}  # recipes built from the run's Toolbox
DEFAULT_TOOLS = ("python -m materl.tools.calculator",)


def names() -> list[str]:
    return sorted([*RECIPES, *FACTORIES])


def get(name: str):
    """The built-in recipe ``name``; a factory-built one gets the default tools (see ``build``)."""
    return build(name)


def build(name: str, toolbox=None):
    """The built-in recipe ``name``. Factories get ``toolbox`` (an unstarted ``ml.mcp_tools(...)``;
    default: the shipped calculator); plain recipes take no toolbox."""
    if name in RECIPES:
        return RECIPES[name]
    if name in FACTORIES:
        if toolbox is None:
            from materl.rollout.mcp import mcp_tools

            toolbox = mcp_tools(*DEFAULT_TOOLS)
        return FACTORIES[name](toolbox)
    from materl.errors import UnknownNameError

    import difflib

    close = difflib.get_close_matches(name, names(), n=1)
    hint = f". Did you mean {close[0]!r}?" if close else ""
    raise UnknownNameError(f"unknown recipe {name!r}; built-in: {', '.join(names())}{hint}")


def doc(name: str) -> str:
    """The recipe's docstring (a factory's module docstring)."""
    if name in FACTORIES:
        import sys

        return sys.modules[FACTORIES[name].__module__].__doc__ or ""
    return getattr(build(name), "doc", "") or ""
