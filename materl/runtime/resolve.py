"""Names in a config that point at user code: ``package.module:attribute``.

    fn = import_symbol("my_rewards:exact", search=[config_dir], what="rewards[0].name")
    recipe = resolve_recipe("my_recipes:tool_grpo", tools=["python -m my_server"], search=[config_dir])

A module is looked up on ``sys.path`` first, then next to the config file and in the working
directory (``search``): the ``materl`` console script, unlike ``python -m materl.cli``, does not
put the working directory on ``sys.path``, so a ``my_rewards.py`` beside the config would
otherwise not be found. The folder a module is found in is added to ``sys.path`` (so its own
sibling imports work too).
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import materl.recipes
from materl.errors import ConfigError
from materl.graph.node import Recipe
from materl.rollout.mcp import mcp_tools

DOTTED = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")  # "package.module:attribute"


def is_dotted(spec: str) -> bool:
    return bool(DOTTED.match(spec))


def import_symbol(spec: str, *, search: Sequence[str | Path] = (), what: str = "name") -> Any:
    """The object ``spec`` (``package.module:attribute``) names; ConfigError naming ``what``."""
    if not is_dotted(spec):
        raise ConfigError(f"{what}={spec!r} is not of the form 'package.module:attribute'")
    module_name, attr = spec.split(":")
    module = _import(module_name, search, what, spec)
    try:
        return getattr(module, attr)
    except AttributeError:
        public = sorted(n for n in vars(module) if not n.startswith("_"))
        raise ConfigError(f"{what}={spec!r}: module {module_name!r} ({module.__file__}) has no attribute {attr!r}; "
                          f"it has: {', '.join(public) or '(nothing public)'}") from None


def _import(module_name: str, search: Sequence[str | Path], what: str, spec: str):
    top = module_name.split(".")[0]
    if importlib.util.find_spec(top) is None:
        for folder in [Path(p).resolve() for p in search]:
            if (folder / f"{top}.py").is_file() or (folder / top / "__init__.py").is_file():
                if str(folder) not in sys.path:
                    sys.path.insert(0, str(folder))
                importlib.invalidate_caches()
                break
        else:
            looked = ", ".join(str(Path(p).resolve()) for p in search) or "(nowhere else)"
            raise ConfigError(f"{what}={spec!r}: no module {top!r} on sys.path, nor in {looked}")
    try:
        return importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{what}={spec!r}: importing {module_name!r} failed: {e}") from e


def resolve_recipe(spec: str, *, tools: Sequence[str] = (), tool_timeout_s: float = 30.0,
                   search: Sequence[str | Path] = (), what: str = "recipe"):
    """A Recipe from a built-in name or ``module:attribute`` (a Recipe, or a factory
    ``f(toolbox) -> Recipe``). Factories get ``ml.mcp_tools(*tools, timeout_s=tool_timeout_s)``;
    a built-in factory with no ``tools`` gets the shipped calculator server."""
    if not is_dotted(spec):
        if spec in materl.recipes.FACTORIES:
            return materl.recipes.build(spec, mcp_tools(*(tools or materl.recipes.DEFAULT_TOOLS),
                                                        timeout_s=tool_timeout_s))
        return materl.recipes.build(spec)
    obj = import_symbol(spec, search=search, what=what)
    if isinstance(obj, Recipe):
        return obj
    if not callable(obj):
        raise ConfigError(f"{what}={spec!r} is a {type(obj).__name__}; accepted: a recipe (@ml.recipe / "
                          f"@ml.algorithm) or a function taking a Toolbox and returning one")
    if not tools:
        raise ConfigError(f"{what}={spec!r} is a recipe factory, which takes the run's Toolbox; list the tool "
                          f"servers under `tools:` (e.g. - python -m materl.tools.calculator)")
    recipe = obj(mcp_tools(*tools, timeout_s=tool_timeout_s))
    if not isinstance(recipe, Recipe):
        raise ConfigError(f"{what}={spec!r} returned a {type(recipe).__name__}, not a recipe")
    return recipe
