"""Turns: the one definition of a rollout's model turns, and the per-batch tensors the turn-level
advantage estimators read (``materl.ops.turn_credit``).

Turn j of a rollout is its j-th generate step plus the untrained tokens after it (tool output, an
environment's reply, a later segment's prompt); tokens before the first generate step are in no
turn. ``turn_index`` gives each completion token's turn (-1: none); an estimator marked
``@rollout_inputs("turns", "states")`` gets, after the node's own tensors,

- ``"turns"``: (B, T) long, ``turn_index`` of each row right-padded with -1;
- ``"states"``: (B, K) long, each turn's anchor state as an id (the same id for the same state
  across the batch; -1 where a row has no turn k). The state of turn j is ``anchor(rollout, j)``
  with the node's ``anchor`` parameter, by default ``observation_anchor``.

Both are computed once per node call from the rollouts, here: an estimator never sees a Rollout.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch
from torch import Tensor

from materl.errors import CompileError, ConfigError
from materl.graph.node import Node
from materl.rollout.types import Rollout

# node parameters read here, not passed to the estimator: parameter -> the rollout input that reads it
ROLLOUT_PARAMS = {"anchor": "states"}


def turn_index(rollout: Rollout) -> list[int]:
    """Per completion token: the 0-based model turn it belongs to, -1 before the first turn."""
    out: list[int] = []
    turn = -1
    for step in rollout.steps:
        if step.kind == "generate":
            turn += 1
        out += [turn] * len(step.token_ids)
    return out


def observation_anchor(rollout: Rollout, turn: int) -> Hashable:
    """GiGPO's default anchor state of turn ``turn``: turn 0's is the prompt (the same for the whole
    group); a later turn's is the ``"anchor"`` an environment put in ``EnvStep.info`` for the turn
    before (the state it moved to; the same state at another turn is the same anchor, as in the
    paper), else the turn's index and the exact token ids of the tool results / environment reply
    that precede it (two episodes whose calls returned the same result are in the same state; the
    same result at another turn is not, since the model's context differs)."""
    if turn == 0:
        return ("prompt",)
    gens = [i for i, s in enumerate(rollout.steps) if s.kind == "generate"]
    before, at = gens[turn - 1], gens[turn]
    given = rollout.steps[before].metadata.get("anchor")
    if given is not None:
        return ("env", given)
    return ("observation", turn, tuple(t for s in rollout.steps[before + 1:at] for t in s.token_ids))


def turns_tensor(node: Node, rollouts: Sequence[Rollout], width: int) -> Tensor:
    out = torch.full((len(rollouts), width), -1, dtype=torch.long)
    for i, r in enumerate(rollouts):
        row = turn_index(r)
        out[i, :len(row)] = torch.tensor(row, dtype=torch.long)
    return out


def states_tensor(node: Node, rollouts: Sequence[Rollout], width: int) -> Tensor:
    anchor: Callable[[Rollout, int], Hashable] = node.params.get("anchor") or observation_anchor
    ids: dict[Hashable, int] = {}
    rows = [[ids.setdefault(_hashable(anchor(r, j), node, j), len(ids)) for j in range(r.num_turns)]
            for r in rollouts]
    out = torch.full((len(rollouts), max([len(x) for x in rows] + [0])), -1, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, :len(row)] = torch.tensor(row, dtype=torch.long)
    return out


def _hashable(key, node: Node, turn: int) -> Hashable:
    try:
        hash(key)
    except TypeError as exc:
        raise ConfigError(f"node {node.name!r}: the anchor function returned {type(key).__name__} {key!r:.80} for "
                          f"turn {turn}; an anchor state must be hashable (a str, int or tuple)") from exc
    return key


ROLLOUT_INPUTS: dict[str, Callable[[Node, Sequence[Rollout], int], Tensor]] = {
    "turns": turns_tensor,
    "states": states_tensor,
}


def rollout_tensors(estimator, node: Node, rollouts: Sequence[Rollout], width: int) -> list[Tensor]:
    """The tensors ``estimator`` declares with ``@rollout_inputs(...)``, in its order."""
    wanted = getattr(estimator, "rollout_inputs", ())
    for param, reader in ROLLOUT_PARAMS.items():
        if param in node.params and reader not in wanted:
            raise CompileError(f"node {node.name!r}: {param}= is read by estimators that take rollout input "
                               f"{reader!r} (gigpo); estimator {node.params.get('estimator')!r} does not")
    out = []
    for name in wanted:
        if name not in ROLLOUT_INPUTS:
            raise CompileError(f"node {node.name!r}: estimator {node.params.get('estimator')!r} asks for rollout "
                               f"input {name!r}; valid: {', '.join(ROLLOUT_INPUTS)}")
        out.append(ROLLOUT_INPUTS[name](node, rollouts, width))
    return out
