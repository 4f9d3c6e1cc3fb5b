"""Readable messages for pydantic validation errors: the field's path, the value received and
what is accepted (type, range, choices, the field's description), with a "did you mean".

    try:
        Options.model_validate(data)
    except ValidationError as e:
        raise ConfigError(describe(e, Options, where="compile options", path_prefix="compile."))
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ValidationError

_BOUNDS = {"greater_than_equal": ">= {ge}", "greater_than": "> {gt}", "less_than_equal": "<= {le}",
           "less_than": "< {lt}"}


def describe(err: ValidationError, model: type[BaseModel], *, where: str, path_prefix: str = "",
             locate: Callable[[tuple], str | None] | None = None) -> str:
    """One line per failure; several failures get a summary line first. ``locate(loc)``, when
    given, says where the failing key was written (``run.yaml:12``), appended in parentheses."""
    lines = []
    for e in err.errors(include_url=False):
        line, at = describe_one(e, model, path_prefix), locate(_loc(e)) if locate else None
        lines.append(f"{line} ({at})" if at else line)
    if len(lines) == 1:
        return f"invalid {where}: {lines[0]}"
    return f"invalid {where}, {len(lines)} errors:\n  " + "\n  ".join(lines)


def _loc(e: dict[str, Any]) -> tuple:
    """The error's field path, without pydantic's validator steps."""
    return tuple(p for p in e["loc"] if not isinstance(p, str) or not p.startswith(("function-", "tuple[")))


def describe_one(e: dict[str, Any], model: type[BaseModel], path_prefix: str = "") -> str:
    loc = _loc(e)
    path = path_prefix + ".".join(str(p) for p in loc) if loc else path_prefix.rstrip(".") or "(top level)"
    kind, ctx, value = e["type"], e.get("ctx") or {}, e.get("input")
    if kind == "extra_forbidden":
        parent, key = loc[:-1], str(loc[-1])
        valid = field_names(model, parent)
        return f"{path}: unknown key {key!r}{did_you_mean(key, valid)}; valid keys: {', '.join(valid)}"
    if kind == "missing":
        return f"{path}: required, missing"
    accepted = accepted_text(model, loc)
    if kind in _BOUNDS:
        return f"{path}={value!r} is out of range; accepted: {_BOUNDS[kind].format(**ctx)}" + _also(accepted)
    if kind == "literal_error":
        return f"{path}={value!r}; accepted: {ctx.get('expected', '')}"
    msg = str(ctx.get("error", e["msg"])).removeprefix("Value error, ")
    if msg.startswith(path):
        return msg
    got = "" if repr(value) in msg or isinstance(value, dict) else f" (got {value!r})"
    if kind == "value_error":  # our validators' messages already say what is accepted
        return f"{path}: {msg}{got}"
    return f"{path}: {msg}{got}" + (f"; accepted: {accepted}" if accepted else "")


def _also(accepted: str) -> str:
    return f" ({accepted})" if accepted else ""


def accepted_text(model: type[BaseModel], loc: tuple) -> str:
    """``an integer >= 1 (episodes per prompt)`` for the field at ``loc``, from its annotation,
    its bounds and its description."""
    field = _field(model, loc)
    if field is None:
        return ""
    kind = type_name(field.annotation)
    bounds = [_BOUNDS[k].format(**{k2: getattr(m, k2)}) for m in field.metadata for k, k2 in
              (("greater_than_equal", "ge"), ("greater_than", "gt"), ("less_than_equal", "le"),
               ("less_than", "lt")) if getattr(m, k2, None) is not None]
    text = " ".join([kind, *bounds]).strip()
    if field.description:
        text += f" ({field.description})"
    return text


def type_name(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        parts = [type_name(a) for a in args if a is not type(None)]
        return " or ".join(parts) + (" or null" if type(None) in args else "")
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is tuple:
        return f"a list of {len(args)} numbers" if args and all(a in (int, float) for a in args) else "a list"
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string", dict: "a mapping"}
    return names.get(origin or annotation, getattr(annotation, "__name__", str(annotation)))


def field_names(model: type[BaseModel], loc: tuple) -> list[str]:
    """Field names of the (nested) model at ``loc`` (for "valid keys: ...")."""
    for part in loc:
        if str(part).isdigit():  # an item of a list section (rewards.0)
            continue
        field = model.model_fields.get(str(part))
        nested = _nested_model(field.annotation) if field is not None else None
        if nested is None:
            return []
        model = nested
    return list(model.model_fields)


def _field(model: type[BaseModel], loc: tuple):
    field = None
    for part in loc:
        if str(part).isdigit():
            continue
        if model is None:
            return None
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        model = _nested_model(field.annotation)
    return field


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    for a in (annotation, *typing.get_args(annotation)):
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


def did_you_mean(name: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(str(name), choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
