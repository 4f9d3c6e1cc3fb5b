"""The self_play op kind: two-player text games, one seat per episode
(``materl.rollout.self_play``).

    rollout = ml.self_play(policy, prompts, game="TicTacToe-v0")                  # both seats trained
    rollout = ml.self_play(policy, prompts, game="TicTacToe-v0", opponent=frozen) # against a frozen copy

Both seats trained: the ``group_size`` episodes of a prompt play ``group_size / 2`` games; member
``j`` of the group plays seat ``j % 2`` of game ``j // 2``, so each seat's turns are an episode of
their own, with their own exact tokens and reward, and the group statistics (the GRPO baseline
and scale) run over all the group's episodes, both seats. The two episodes of a game meet in a
table of open matches keyed by (rollout, group, game), so they must run in the same process
(the in-process rollout, or one Ray worker per group, which is how workers split a batch) and
at once (``max_concurrent_episodes >= 2``; episodes start in index order, so the two seats of
the earliest unfinished game always both hold a slot).

Against an opponent: every episode is one game; member ``j`` plays seat ``j % 2`` with the
policy, and the opponent agent plays the other seat in the same episode, its turns sampled by
its own engine and never trained (its tokens are not in the episode). Its weights are whatever
``ml.compile(..., opponent=ml.Agent(...))`` was given: a non-trainable agent is never updated.

Each episode's ``game_seed`` column (else the group index) seeds its games, so a group's games
start from the same position.
"""

from __future__ import annotations

import anyio

from materl.compiler.context import StageEnv, sampling
from materl.compiler.episode import Episode
from materl.compiler.spec import Impl, Kind, OpSpec, Output, Role
from materl.errors import CompileError, EpisodeError
from materl.graph.node import Node
from materl.rollout.self_play import Match, make_game, play_seat
from materl.rollout.types import Rollout

_OPEN: dict[tuple, Match] = {}  # games whose first seat has arrived: (rollout id, group, game) -> Match
OPPONENT_SEED = 500_009  # the opponent's sampling seeds: the episode's, shifted


async def self_play_episode(run: StageEnv, node: Node, ep: Episode, prompt) -> Rollout:
    policy, size = run.agent(node), run.options.group_size
    member = ep.index - ep.group * size
    max_moves = node.params.get("max_moves") or 2 * run.options.max_turns
    seed = int(ep.columns.get("game_seed", ep.group))
    system = run.options.system_prompt
    if len(node.agents) > 1:
        return await _against(run, node, ep, seat=member % 2, seed=seed, max_moves=max_moves)
    problems = _both_seats_problems(node, size, run.options.max_concurrent_episodes)
    if problems:  # checked when compiled too; here for a rollout called with another group_size
        raise CompileError(problems[0])
    game_no, seat = divmod(member, 2)
    key = (run.ctx.rollout_id, ep.group, game_no)
    match = _OPEN.pop(key, None)
    if match is None:
        match = _OPEN[key] = Match(make_game(node.params["game"]), seed=seed, max_moves=max_moves)
    try:
        rollout = await play_seat(match, seat, policy.engine, policy.tokenizer,
                                  lambda t: sampling(run, node, ep.seed, t), system=system)
    except BaseException:
        if _OPEN.get(key) is match:  # failed before the other seat came: it starts a game of its own
            del _OPEN[key]
        raise
    # a game over before the other seat came stays open for it: it finds the game over, not a new one
    return _record(ep, rollout, match, seat)


async def _against(run: StageEnv, node: Node, ep: Episode, *, seat: int, seed: int, max_moves: int) -> Rollout:
    """The policy plays ``seat`` and the opponent the other one, concurrently, in this episode."""
    policy, opponent = run.agent(node), run.agents[node.agents[1]]
    match = Match(make_game(node.params["game"]), seed=seed, max_moves=max_moves)
    system, out = run.options.system_prompt, {}

    async def opponent_seat() -> None:
        await play_seat(match, 1 - seat, opponent.engine, opponent.tokenizer,
                        lambda t: sampling(run, node, ep.seed + OPPONENT_SEED, t), system=system)

    async with anyio.create_task_group() as tg:
        tg.start_soon(opponent_seat)
        out["rollout"] = await play_seat(match, seat, policy.engine, policy.tokenizer,
                                         lambda t: sampling(run, node, ep.seed, t), system=system)
    return _record(ep, out["rollout"], match, seat)


def _both_seats_problems(node: Node, group_size: int, max_concurrent_episodes: int) -> list[str]:
    if len(node.agents) > 1:
        return []
    out = []
    if group_size % 2:
        out.append(f"self_play {node.name!r} with both seats trained needs an even group_size (two seats per "
                   f"game), got group_size={group_size}")
    if max_concurrent_episodes < 2:
        out.append(f"self_play {node.name!r} with both seats trained needs max_concurrent_episodes >= 2 (the two "
                   f"seats of a game play at once), got {max_concurrent_episodes}")
    return out


def check_self_play(node: Node, info) -> list[str]:
    """Compile time: both seats trained need an even group and two episodes at once."""
    o = info.options
    return [] if o is None else _both_seats_problems(node, o.group_size, o.max_concurrent_episodes)


def _record(ep: Episode, rollout: Rollout | None, match: Match, seat: int) -> Rollout:
    if rollout is None:  # nothing sampled, nothing to train: the episode fails, the step goes on
        raise EpisodeError(f"seat {seat} never moved: the game ended before its first turn "
                           f"({match.info.get('reason', '')}); nothing to train")
    meta = rollout.metadata
    for outcome in ("win", "draw", "loss"):
        ep.metrics[f"self_play/{outcome}"] = float(meta["outcome"] == outcome)
    ep.metrics["self_play/invalid_moves"] = float(meta["invalid_moves"])
    ep.metrics["self_play/moves"] = float(meta["moves"])
    return rollout


SPECS = (
    OpSpec("self_play", Role.ROLLOUT, (Output("rollout", Kind.ROLLOUT),),
           (Impl("engine", episode=self_play_episode),), locality="episode", check=check_self_play,
           doc="one seat of a two-player text game per episode (both seats trained, or against an opponent)"),
)
