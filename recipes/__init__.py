"""Built-in recipes, one algorithm per file. ``materl.recipes.names()`` lists them."""

from materl.recipes.dapo import dapo
from materl.recipes.dpo import dpo
from materl.recipes.dr_grpo import dr_grpo
from materl.recipes.grpo import grpo
from materl.recipes.gspo import gspo
from materl.recipes.ppo import ppo
from materl.recipes.reinforce_pp import reinforce_pp
from materl.recipes.remax import remax
from materl.recipes.rloo import rloo
from materl.recipes.vapo import vapo

RECIPES = {r.name: r for r in (grpo, dr_grpo, dapo, gspo, rloo, reinforce_pp, remax, ppo, vapo, dpo)}


def names() -> list[str]:
    return sorted(RECIPES)


def get(name: str):
    from materl.errors import UnknownNameError

    if name not in RECIPES:
        import difflib

        close = difflib.get_close_matches(name, RECIPES, n=1)
        hint = f". Did you mean {close[0]!r}?" if close else ""
        raise UnknownNameError(f"unknown recipe {name!r}; built-in: {', '.join(names())}{hint}")
    return RECIPES[name]
