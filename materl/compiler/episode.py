"""Episodes: one dataset row's rollout and everything computed about it, and how values move
between one episode and a batch of them.

Every node stores one value per episode (``Episode.store``). A node with several named outputs
stores an ``Outputs`` mapping, read as ``%node`` (its first output) or ``%node.name``
(``Episode.resolve``). A group or batch node reads its inputs collated over its episodes
(``collate``: by the producing op's output kind) and its result is split back per episode
(``split``), with the row count checked, so a wrong-sized output fails naming the op.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from materl.compiler.spec import Kind, Role
from materl.errors import CompileError, ShapeError
from materl.rollout.multiturn import EpisodeState, TurnResult
from materl.rollout.types import Rollout


class Outputs(dict):
    """A node's named outputs (``{"advantages": ..., "returns": ...}``); the first is its value."""
    @property
    def default(self) -> Any:
        return next(iter(self.values()))


@dataclass
class Episode:
    index: int  # position in the step's batch
    group: int  # dense group index (the prompt's position)
    group_id: Hashable  # the row's "id" column, else its position
    prompt: Any  # str, chat messages, or a dataset row's prompt
    columns: dict[str, Any]  # the row's other columns (answer, ...)
    seed: int
    uid: str = ""  # unique in the process: the episode id tool servers see
    values: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)  # readable records for the run's samples (a judge's answer)
    error: Any = None  # a materl.compiler.failures.Failure once the episode failed
    filtered: bool = False  # left out by a group filter (dynamic sampling)
    infra: str | None = None  # the first tool failure that was not the model's (failures.INFRA_ERROR_KINDS)
    excluded: str | None = None  # why it is left out of baselines and the update (infra_failures="mask")
    infra_raised: bool = False  # ``infra`` came from an outage the agent's own tool client raised

    @property
    def ok(self) -> bool:
        return self.error is None and not self.filtered and self.excluded is None

    def store(self, name: str, value: Any) -> None:
        self.values[name] = value

    def resolve(self, ref: str) -> Any:
        """``"node"``, ``"node.output"`` (a named output) or ``"node.field.field"`` (attributes)."""
        return self.lookup(*parse_ref(ref))

    def lookup(self, head: str, path: Sequence[str]) -> Any:
        """``resolve`` of a reference already split by ``parse_ref``."""
        obj = self.values[head]
        if isinstance(obj, Outputs):
            if path and path[0] in obj:
                obj, path = obj[path[0]], path[1:]
            else:
                obj = obj.default
        for attr in path:
            obj = obj[attr] if isinstance(obj, dict) else getattr(obj, attr)
        return obj

    def rollout(self, name: str) -> Rollout:
        """The Rollout stored by node ``name``."""
        return as_rollout(self.resolve(name))


def parse_ref(ref: str) -> tuple[str, tuple[str, ...]]:
    """``"node.output.field"`` as ``("node", ("output", "field"))``."""
    head, *path = ref.split(".")
    return head, tuple(path)


def make_episodes(ctx, prompts: Sequence[Any] | None, columns: dict[str, Sequence[Any]], group_size: int, *,
                  groups: Sequence[int] | None = None) -> list[Episode]:
    """The episodes of one rollout: ``group_size`` per prompt for recipes that generate (one for
    offline data), each with its row's other columns, a seed from (options.seed, step, index)
    and a uid unique in the process. A prompt row that is a dict gives its ``prompt`` or
    ``messages`` as the prompt and its other keys as columns. ``groups``: each prompt's index in
    the step's whole batch (default 0, 1, ...), for a worker that runs part of a batch: an
    episode's index, seed and uid then do not depend on which worker runs it."""
    plan = ctx.plan
    columns = dict(columns)
    data_inputs = [n.name for n in plan.recipe.nodes if plan.role(n.name) is Role.DATA]
    if prompts is None:
        if len(data_inputs) == 1 and data_inputs[0] in columns:
            prompts = columns.pop(data_inputs[0])
        else:
            raise CompileError(f"run() needs the recipe's data input(s): {', '.join(data_inputs)}")
    rows = list(prompts)
    for k, v in columns.items():
        if len(v) != len(rows):
            raise CompileError(f"column {k!r} has {len(v)} values for {len(rows)} prompts")
    generates = plan.generates()
    g = group_size if generates else 1
    groups = list(groups) if groups is not None else list(range(len(rows)))
    if len(groups) != len(rows):
        raise CompileError(f"make_episodes: {len(groups)} group indices for {len(rows)} prompts")
    episodes = []
    for p, (row, group) in enumerate(zip(rows, groups)):
        cols = {k: v[p] for k, v in columns.items()}
        prompt = row
        if isinstance(row, dict) and generates:
            cols = {**{k: v for k, v in row.items() if k not in ("prompt", "messages")}, **cols}
            prompt = row.get("prompt", row.get("messages"))
        gid = cols.get("id", group)
        for j in range(g):
            idx = group * g + j
            seed = ctx.options.seed * 1_000_003 + ctx.step * 100_003 + idx
            ep = Episode(idx, group, gid, prompt, cols, seed, uid=f"{ctx.rollout_id}-{idx}")
            for name in data_inputs:
                ep.store(name, prompt if len(data_inputs) == 1 else row[name])
            episodes.append(ep)
    return episodes


def as_rollout(x: Any) -> Rollout:
    if isinstance(x, Rollout):
        return x
    if isinstance(x, (TurnResult, EpisodeState)):
        return x.rollout
    raise CompileError(f"expected a rollout (from generate, generate_step, structure_rollout or env_rollout), "
                       f"got {type(x).__name__}")


class RolloutBatch(list):
    """A list of Rollouts whose attributes project over its items (``batch.text`` -> list[str])."""
    def __getattr__(self, attr: str):
        if attr.startswith("_"):
            raise AttributeError(attr)
        return collate([getattr(r, attr) for r in self])


# ----------------------------------------------------------------------------- batching


def collate(items: list[Any], kind: Kind | None = None) -> Any:
    """Per-episode values as one batch value. With the producing output's ``kind``: rollouts ->
    RolloutBatch, numbers -> (n,) float32, per-token values -> right-padded (n, T) float32.
    Without (data columns, custom ops' outputs): the same by what the values are, else a list."""
    if kind is Kind.ROLLOUT:
        return RolloutBatch(as_rollout(x) for x in items)
    if kind in (Kind.ROW, Kind.FLAG, Kind.TOKENS, Kind.SCORE):
        return to_tensor(items)
    if not items:
        return items
    if all(isinstance(x, (int, float, bool)) or (isinstance(x, Tensor) and x.dim() == 0) for x in items):
        return torch.tensor([float(x) for x in items], dtype=torch.float32)
    if all(isinstance(x, (Rollout, TurnResult, EpisodeState)) for x in items):
        return RolloutBatch(as_rollout(x) for x in items)
    if all(isinstance(x, Tensor) and x.dim() == 1 for x in items):
        return pad_rows([x.tolist() for x in items], dtype=items[0].dtype)
    if all(isinstance(x, list) and x and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in x)
           for x in items):
        is_int = all(isinstance(v, int) for x in items for v in x)
        return pad_rows(items, dtype=torch.long if is_int else torch.float32)
    return list(items)


def to_tensor(items: Sequence[Any], *, width: int | None = None) -> Tensor:
    """Per-episode numbers (n,) or per-token rows, right-padded to ``width`` (default: the
    longest), as float32. A row longer than ``width`` is an error, never truncated."""
    if isinstance(items, Tensor):
        t = items.float()
    elif all(is_scalar(x) for x in items):
        t = torch.tensor([float(x) for x in items], dtype=torch.float32)
    else:
        rows = [x.tolist() if isinstance(x, Tensor) else list(x) if not is_scalar(x) else [float(x)] for x in items]
        t = pad_rows(rows, width=width)
    if t.dim() == 2 and width is not None and t.shape[1] != width:
        if t.shape[1] > width:
            raise ShapeError(f"per-token values of width {t.shape[1]} for completions of at most {width} tokens")
        t = torch.nn.functional.pad(t, (0, width - t.shape[1]))
    return t


def is_scalar(x: Any) -> bool:
    return isinstance(x, (int, float, bool)) or (isinstance(x, Tensor) and x.dim() == 0)


def pad_rows(rows: list[list], *, dtype=torch.float32, pad: float = 0, width: int | None = None) -> Tensor:
    width = max([len(r) for r in rows] + [width or 0])
    if all(type(r) is list for r in rows):  # plain rows: one tensor from the padded lists
        try:
            return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=dtype).reshape(len(rows), width)
        except (TypeError, ValueError, RuntimeError):
            pass  # rows of tensors or mixed items: copied row by row below
    out = torch.full((len(rows), width), pad, dtype=dtype)
    for i, r in enumerate(rows):
        if len(r):
            out[i, : len(r)] = torch.as_tensor(r, dtype=dtype)
    return out


def split(value: Any, n: int, *, what: str) -> list[Any]:
    """A group/batch result as one value per episode: n rows (a tensor's first dimension, a
    list, or each entry of a dict of outputs), or a single number for all. ``what`` names the
    op in the error raised for any other row count."""
    if isinstance(value, dict):
        parts = {k: split(v, n, what=f"{what} output {k!r}") for k, v in value.items()}
        return [Outputs({k: parts[k][i] for k in parts}) for i in range(n)]
    if is_scalar(value) or value is None:
        return [value] * n
    if isinstance(value, Tensor):
        rows = value.shape[0]
    elif isinstance(value, (list, tuple)):
        rows = len(value)
    else:
        raise ShapeError(f"{what} returned {type(value).__name__}; a group or batch op returns one value per "
                         f"episode ({n} here): a list, a tensor with {n} rows, or a dict of those")
    if rows != n:
        shape = list(value.shape) if isinstance(value, Tensor) else f"{rows} items"
        raise ShapeError(f"{what} returned {shape} for {n} episodes; expected {n} rows (one per episode)")
    return [value[i] for i in range(n)]
