"""``ml.self_play``: one seat of a two-player text game per episode (see
``materl.compiler.kinds.self_play`` and ``materl.rollout.self_play``)."""

from __future__ import annotations

from materl.errors import RecipeError
from materl.graph.trace import Value, active_builder


def self_play(policy, prompts, *, game="TicTacToe-v0", opponent=None, max_moves: int | None = None,
              name: str | None = None) -> Value:
    """Episodes that are seats of two-player games. ``game``: a textarena id (``"TicTacToe-v0"``,
    ``"Nim-v0"`` ...: the ``envs`` extra) or a factory returning a fresh
    ``materl.rollout.self_play.TwoPlayerGame``. Without ``opponent`` the policy plays both seats
    and both are trained: a group of ``group_size`` (even) episodes is ``group_size / 2`` games,
    each seat's turns an episode of its own. With ``opponent`` (an agent parameter of the recipe,
    e.g. a frozen copy of the policy's starting weights) each episode is one game, the policy's
    seat alternating with the episode, the opponent's turns sampled by its own engine and not
    trained. ``max_moves``: moves (both seats, retries included) after which a game is a draw
    (default 2 x the ``max_turns`` compile option). The value is the seat's Rollout, its outcome
    in ``metadata`` (``seat``, ``reward``, ``outcome``, ``invalid_moves``, ``moves``); score it
    with ``ml.reward(materl.rollout.self_play.game_outcome, rollout=...)``."""
    if not (isinstance(game, str) or callable(game)):
        raise RecipeError(f"ml.self_play(game=...) takes a textarena id such as 'TicTacToe-v0' or a factory "
                          f"returning a fresh two-player game, got {game!r}")
    if max_moves is not None and (not isinstance(max_moves, int) or max_moves < 1):
        raise RecipeError(f"ml.self_play(max_moves=...) takes a positive int, got {max_moves!r}")
    b = active_builder("ml.self_play")
    agents = [b.agent(policy, "ml.self_play")]
    if opponent is not None:
        agents.append(b.agent(opponent, "ml.self_play(opponent=...)"))
        if agents[1].name == agents[0].name:
            raise RecipeError(f"ml.self_play(opponent=...) names the policy {agents[0].name!r} itself; without "
                              f"opponent= the policy already plays both seats")
    params = {"game": game, **({"max_moves": max_moves} if max_moves else {})}
    return b.add("self_play", [*agents, prompts], params, scope="episode", name=name, default_name="rollout",
                 fixed_scope=True)
