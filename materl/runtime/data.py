"""Datasets for training: Python lists, JSONL files, or `datasets` objects, as rows (dicts).

Every row is checked when it is loaded, and a bad one is reported with where it came from
(``data/train.jsonl:7``, ``row 3``, ``data/hf row 3``): a file that is not UTF-8 or a line that is
not a JSON object, a row with neither ``prompt`` nor ``messages``, an empty or whitespace
prompt, ``messages`` that are not a list of ``{"role", "content"}`` with a known role and string
content. ``check_columns`` adds the columns the rewards of a compiled step read (a row without
``answer`` would otherwise be scored against ``None``); ``materl.runtime.prompts`` the length of
each prompt against the model's context. (verl: ``RLHFDataset`` filters over-long prompts and
drops nothing else; TRL checks nothing at load. Deliberate difference: materl refuses the data
and names the row.)

Order is a seeded permutation per epoch, so a (epoch, index) position is all that resuming needs.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from materl.errors import ConfigError, DataError

ROLES = ("system", "user", "assistant", "tool")
MAX_LISTED = 5  # bad rows listed in one error (the count says how many in all)


class Row(dict):
    """A dataset row: a dict of its columns that also remembers where it came from (``origin``:
    ``file:line``, ``row i`` or ``folder row i``) for error messages. ``origin`` is not a column."""

    origin: str = ""

    def __init__(self, data: Mapping[str, Any], origin: str = ""):
        super().__init__(data)
        self.origin = origin

    def __reduce__(self):  # keep the origin across pickling (Ray workers)
        return (Row, (dict(self), self.origin))


def load_rows(data: Any, *, where: str | None = None) -> list[Row]:
    """Rows with at least ``prompt`` (str or chat messages), ``messages`` or ``chosen``, each
    checked (see the module docstring). ``data``: a ``.jsonl`` (or ``.json`` list) file, a
    ``datasets.Dataset``, or an iterable of dicts / strings. ``where`` names an in-memory source
    in messages (``data/hf`` for a folder saved by ``datasets``). Raises ``DataError`` listing
    the first bad rows with their file:line or index."""
    if isinstance(data, (str, Path)):
        items = _read_file(Path(data))
    else:
        rows = data.to_list() if hasattr(data, "to_list") else list(data)  # datasets.Dataset, or rows
        prefix = f"{where} row" if where else "row"
        items = [(r.origin if isinstance(r, Row) and r.origin else f"{prefix} {i}", r) for i, r in enumerate(rows)]
    out, problems = [], []
    for origin, r in items:
        try:
            out.append(Row(_checked_row(r), origin))
        except DataError as e:
            problems.append(f"{origin}: {e}")
    raise_problems(problems, what="dataset row")
    if not out:
        name = where or (str(data) if isinstance(data, (str, Path)) else None)
        raise DataError(f"the dataset{f' {name!r}' if name else ''} is empty")
    return out


def raise_problems(problems: list[str], *, what: str) -> None:
    """One DataError for ``problems`` (one line each): the first few listed, the count said."""
    if not problems:
        return
    if len(problems) == 1:
        raise DataError(problems[0])
    more = f"\n(and {len(problems) - MAX_LISTED} more)" if len(problems) > MAX_LISTED else ""
    raise DataError(f"{len(problems)} bad {what}s:\n" + "\n".join(problems[:MAX_LISTED]) + more)


def _read_file(path: Path) -> list[tuple[str, Any]]:
    """(``file:line``, parsed JSON) per non-blank line of a ``.jsonl`` file (a ``.json`` file
    holds one list of rows); errors name the file and line."""
    if not path.is_file():
        raise ConfigError(f"dataset file {str(path)!r} does not exist" if not path.exists()
                          else f"dataset path {str(path)!r} is not a file")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        col = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise DataError(f"{path}:{line}: not UTF-8 text (byte {raw[e.start]:#04x} at column {col}); "
                        f"save the file as UTF-8") from None
    if path.suffix == ".json":
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: not valid JSON: {e.msg} (column {e.colno})") from None
        if not isinstance(rows, list):
            raise DataError(f"{path}: a .json dataset must hold a list of rows, got {type(rows).__name__}")
        return [(f"{path} row {i}", r) for i, r in enumerate(rows)]
    items = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            items.append((f"{path}:{n}", json.loads(line)))
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{n}: not valid JSON: {e.msg} (column {e.colno}): {line[:60]!r}") from None
    return items


def _checked_row(r: Any) -> dict:
    """The row as a dict, or DataError saying what is wrong with it (no location: the caller's)."""
    if isinstance(r, str):
        r = {"prompt": r}
    if not isinstance(r, Mapping):
        raise DataError(f"a row must be an object with 'prompt' or 'messages', got {type(r).__name__} "
                        f"{str(r)[:60]!r}")
    if not ("prompt" in r or "messages" in r or "chosen" in r):
        raise DataError(f"the row needs a 'prompt' (or 'messages'); it has {', '.join(map(repr, r)) or 'no keys'}")
    for key in ("prompt", "messages"):
        if key in r:
            check_prompt(r[key], key=key)
    return dict(r)


def check_prompt(prompt: Any, *, key: str = "prompt") -> None:
    """DataError unless ``prompt`` is a non-blank string or a valid list of chat messages."""
    if isinstance(prompt, str) and key == "prompt":
        if not prompt.strip():
            raise DataError(f"{key!r} is {'empty' if not prompt else 'only whitespace'} ({prompt!r})")
        return
    if key == "prompt" and not isinstance(prompt, list):
        raise DataError(f"'prompt' must be a string or a list of chat messages, got {type(prompt).__name__} "
                        f"{str(prompt)[:60]!r}")
    check_messages(prompt, key=key)


def check_messages(messages: Any, *, key: str = "messages") -> None:
    """DataError unless ``messages`` is a list of ``{"role": one of ROLES, "content": str}`` with
    a user message that is not blank (an assistant message with ``tool_calls`` may have no content)."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{key!r} must be a non-empty list of {{'role', 'content'}} messages, got "
                        f"{type(messages).__name__} {str(messages)[:60]!r}")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise DataError(f"{key}[{i}] must be an object with 'role' and 'content', got {type(m).__name__} "
                            f"{str(m)[:60]!r}")
        role = m.get("role")
        if role not in ROLES:
            raise DataError(f"{key}[{i}].role={role!r}; accepted: {', '.join(ROLES)}")
        content = m.get("content")
        if not isinstance(content, str) and not (role == "assistant" and content is None and m.get("tool_calls")):
            raise DataError(f"{key}[{i}].content must be a string, got {type(content).__name__} {str(content)[:60]!r}")
    if not any(m["role"] == "user" and m["content"].strip() for m in messages):
        raise DataError(f"{key!r} has no user message with text (roles: {', '.join(m['role'] for m in messages)})")


def check_columns(rows: Iterable[Row], required: Mapping[str, list[str]]) -> None:
    """DataError naming every row (file:line or index) that lacks a column in ``required``
    (column -> the rewards that read it) or holds null there."""
    problems = []
    for r in rows:
        missing = [c for c in required if r.get(c) is None]
        for c in missing:
            readers = ", ".join(repr(n) for n in required[c])
            state = "is null" if c in r else "is missing"
            problems.append(f"{getattr(r, 'origin', '') or 'row'}: column {c!r}, which reward {readers} reads, "
                            f"{state}; the row has: {', '.join(sorted(r)) or 'nothing'}")
    raise_problems(problems, what="dataset row")


class Sampler:
    """Deterministic batches over rows: a fresh seeded permutation each epoch."""

    def __init__(self, rows: list[dict], *, batch_size: int, seed: int = 0, shuffle: bool = True):
        self.rows, self.batch_size, self.seed, self.shuffle = rows, batch_size, seed, shuffle
        self.epoch, self.index = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.rows)))
        return torch.randperm(len(self.rows), generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()

    def next_batch(self) -> list[dict]:
        batch = []
        while len(batch) < self.batch_size:
            if self.index >= len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._permutation()
            batch.append(self.rows[self._order[self.index]])
            self.index += 1
        return batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._permutation()


def split_columns(rows: list[dict]) -> tuple[list, dict[str, list]]:
    """Rows -> (prompts, {column: values}) for ``compiled.run``."""
    prompts = [r.get("prompt", r.get("messages")) for r in rows]
    keys = sorted({k for r in rows for k in r} - {"prompt", "messages"})
    return prompts, {k: [r.get(k) for r in rows] for k in keys}
