"""The YAML layer of configs: reading a file (UTF-8, YAML 1.2 floats, no key written twice),
``section.key=value`` overrides, and the line of each key for error messages. The typed record
and its checks are ``materl.runtime.config``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from materl.errors import ConfigError


class DuplicateKey(yaml.YAMLError):
    """A YAML mapping names a key twice (PyYAML would keep the last value silently)."""

    def __init__(self, key: Any, line: int, first: int):
        super().__init__(f"line {line}: duplicate key {key!r} (first at line {first})")
        self.key, self.line, self.first = key, line, first


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, reading ``1e-5`` as a float (YAML 1.2) rather than a string, and
    refusing a key written twice in one mapping (``DuplicateKey``, with both lines)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):  # its own keys; a merged (<<) key may be overridden
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
                try:
                    if key in seen:
                        raise DuplicateKey(key, line, seen[key])
                    seen[key] = line
                except TypeError:  # an unhashable key: the base class reports it
                    break
        return super().construct_mapping(node, deep=deep)

_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d[\d_]*\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."),
)


def parse_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


def read_config_data(path: str | Path) -> dict[str, Any]:
    """The YAML mapping of a config file, unvalidated; ConfigError for a missing file, text that
    is not UTF-8, bad YAML, a key written twice or a top level that is not a mapping."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read config file {str(path)!r}: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text: byte {raw[e.start]:#04x} on line {line} "
                          f"({path}:{line}); save it as UTF-8") from None
    try:
        data = parse_yaml(text) or {}
    except DuplicateKey as e:
        raise ConfigError(f"{path}:{e.line}: duplicate key {e.key!r} (first at line {e.first}); a key may appear "
                          f"once per section (YAML would keep only the last value)") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections, got {type(data).__name__}")
    return data


def apply_override(data: dict[str, Any], item: str) -> None:
    """Set ``data[a][b][c] = yaml(value)`` for ``item = "a.b.c=value"`` (in place)."""
    key, sep, raw = item.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        raise ConfigError(f"override {item!r} is not of the form section.key=value (e.g. train.steps=3)")
    try:
        value = parse_yaml(raw) if raw.strip() else ""
    except DuplicateKey as e:
        raise ConfigError(f"override {item!r}: duplicate key {e.key!r} in its value") from None
    except yaml.YAMLError:
        value = raw
    node: Any = data
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        where = ".".join(parts[: depth + 1])
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"override {item!r}: {where!r} is not an index of a list of {len(node)} items")
            index: Any = int(part)
        elif isinstance(node, dict):
            index = part
            if not last and node.get(part) is None:
                node[part] = {}
        else:
            raise ConfigError(f"override {item!r}: {'.'.join(parts[:depth])!r} is a value, not a section")
        if last:
            node[index] = value
        else:
            node = node[index]



def key_lines(text: str) -> dict[tuple, int]:
    """The 1-based line of each key of a YAML config, by path (``("teacher", "name") -> 12``;
    list items by index); {} for text that is not YAML."""
    try:
        root = yaml.compose(text, Loader=_Loader)
    except yaml.YAMLError:
        return {}
    out: dict[tuple, int] = {}

    def walk(node: Any, path: tuple) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode):
                    out[(*path, key.value)] = key.start_mark.line + 1
                    walk(value, (*path, key.value))
        elif isinstance(node, yaml.SequenceNode):
            for i, value in enumerate(node.value):
                out[(*path, i)] = value.start_mark.line + 1
                walk(value, (*path, i))

    walk(root, ())
    return out
