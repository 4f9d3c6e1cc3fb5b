"""Two-player text games played by language models, one seat per episode.

A game is anything with these five methods (no base class; ``TextArenaGame`` wraps textarena's
two-player games, which run offline)::

    class TwoPlayerGame(Protocol):
        def reset(self, seed: int) -> None
        def current_seat(self) -> int              # whose move it is: 0 or 1
        def observe(self, seat: int) -> str        # what ``seat`` has not seen yet (its next user turn)
        def act(self, text: str) -> bool          # the current seat's move; True when the game is over
                                                   # (``last_invalid``: the move was refused and may be retried)
        def outcome(self) -> tuple[list[float], dict]  # per-seat rewards and why the game ended

A ``Match`` is one game between two seats. Each seat plays it from its own coroutine
(``play_seat``), with its own token sequence: its first user turn is its first observation, each
model turn is sampled by that seat's engine (the policy's, or a frozen opponent's) and kept
exactly as sampled, and what happened since its last move (the other seat's move, the board) is
appended as an untrained user turn, the way ``materl.rollout.env`` appends an environment's
answer. Nothing is decoded and tokenized again. The seat's reward is the game's outcome for it.

Invalid moves are the game's rule: textarena tells the seat what was wrong and lets it retry
(``error_allowance`` times, default 1); another invalid move loses the game (-1; the other seat
+1). A game still running after ``max_moves`` moves ends as a draw (0 for both). A seat's
coroutine that fails (its engine raised, its episode was cancelled) aborts the match, so the
other seat's episode fails with the reason instead of waiting.

Counterparts: textarena's own offline loop (``env.step``/``get_observation``, one model call per
turn from the whole rendered history); SPIRAL (Liu et al. 2025, arXiv:2506.24119) trains both
seats of such games with role-conditioned advantages; OpenRLHF and verl have no self-play loop.
"""

from __future__ import annotations

from dataclasses import replace as dc_replace
from typing import Any, Protocol, runtime_checkable

import anyio

from materl.errors import ConfigError, EpisodeError, UnknownNameError
from materl.rollout.multiturn import EpisodeState, append_turn, sample_turn
from materl.rollout.types import Rollout


@runtime_checkable
class TwoPlayerGame(Protocol):
    def reset(self, seed: int) -> None: ...

    def current_seat(self) -> int: ...

    def observe(self, seat: int) -> str: ...

    def act(self, text: str) -> bool: ...

    def outcome(self) -> tuple[list[float], dict]: ...


class TextArenaGame:
    """A two-player game of textarena (``env_id`` as ``textarena.make`` takes it, e.g.
    ``"TicTacToe-v0"``, ``"Nim-v0"``, ``"ConnectFour-v0"``), without its LLM wrappers: each seat
    gets only its new messages, as ``[GAME] ...`` lines. ``kwargs`` go to the game's constructor
    ``error_allowance``: how many invalid moves in a row a seat may retry before it loses
    (textarena's own state attribute; None keeps the game's, 1 for its two-player games). Needs
    the ``envs`` extra (``pip install -c constraints.txt -e ".[envs]"``)."""

    def __init__(self, env_id: str = "TicTacToe-v0", *, error_allowance: int | None = None, **kwargs: Any):
        if error_allowance is not None and (not isinstance(error_allowance, int) or error_allowance < 0):
            raise ConfigError(f"TextArenaGame(error_allowance=...) takes an int >= 0, got {error_allowance!r}")
        self.env_id, self.kwargs, self.error_allowance = env_id, kwargs, error_allowance
        self.env = _textarena_env(env_id, kwargs)
        self.done, self.last_invalid = False, False

    def __repr__(self) -> str:
        return f"TextArenaGame({self.env_id!r})"

    def reset(self, seed: int) -> None:
        self.env.reset(num_players=2, seed=seed)
        if self.error_allowance is not None:
            self.env.state.error_allowance = self.error_allowance
        self.done = False

    def current_seat(self) -> int:
        return int(self.env.state.current_player_id)

    def observe(self, seat: int) -> str:
        observations = self.env.state.observations
        messages, observations[seat] = list(observations.get(seat, [])), []
        return "\n".join(f"[{_sender(self.env, s)}] {m}".strip() for s, m, *_ in messages)

    def act(self, text: str) -> bool:
        errors = self.env.state.error_count
        self.done, _ = self.env.step(text)
        self.last_invalid = self.env.state.error_count > errors  # told why, and asked again
        return bool(self.done)

    def outcome(self) -> tuple[list[float], dict]:
        rewards, info = self.env.close()
        rewards = rewards or {0: 0.0, 1: 0.0}
        return [float(rewards[0]), float(rewards[1])], {"reason": _reason(info), "invalid": _invalid(info)}


def _textarena_env(env_id: str, kwargs: dict):
    try:
        import textarena as ta
    except ImportError as e:
        raise ConfigError("self-play with textarena games needs the envs extra: "
                          "pip install -c constraints.txt -e \".[envs]\"") from e
    from textarena.envs.registration import ENV_REGISTRY

    if env_id not in ENV_REGISTRY:
        import difflib

        close = difflib.get_close_matches(env_id, ENV_REGISTRY, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UnknownNameError(f"unknown textarena game {env_id!r}{hint}; e.g. TicTacToe-v0, Nim-v0, ConnectFour-v0, "
                               f"KuhnPoker-v0 ({len(ENV_REGISTRY)} ids)")
    env = ta.make(env_id, **kwargs)
    while isinstance(env, ta.Wrapper):  # the raw game: per-seat message queues, no re-rendered history
        env = env.env
    return env


def _sender(env, sender: int) -> str:
    return "GAME" if sender < 0 else env.state.role_mapping.get(sender, f"Player {sender}")


def _reason(info: dict) -> str:
    return next((str(v.get("reason")) for v in (info or {}).values() if isinstance(v, dict) and v.get("reason")), "")


def _invalid(info: dict) -> list[bool]:
    return [bool((info or {}).get(s, {}).get("invalid_move", False)) for s in (0, 1)]


def make_game(game) -> TwoPlayerGame:
    """``game``: a textarena id (str), or a factory returning a fresh ``TwoPlayerGame``."""
    if isinstance(game, str):
        return TextArenaGame(game)
    if not callable(game):
        raise ConfigError(f"self-play needs a game: a textarena id such as 'TicTacToe-v0' or a factory returning "
                          f"a fresh two-player game, got {game!r}")
    made = game()
    missing = [m for m in ("reset", "current_seat", "observe", "act", "outcome") if not callable(getattr(made, m, None))]
    if missing:
        raise ConfigError(f"self-play game factory {game!r} made {type(made).__name__}, which lacks "
                          f"{', '.join(missing)} (see materl.rollout.self_play.TwoPlayerGame)")
    return made


class Match:
    """One game between seats 0 and 1, played from two coroutines (``play_seat``). The seats
    wait for their turn on an event that every move (and the end) replaces."""

    def __init__(self, game: TwoPlayerGame, *, seed: int, max_moves: int):
        self.game, self.max_moves, self.moves = game, max_moves, 0
        self.invalid = [0, 0]
        self.done, self.error, self.rewards, self.info = False, None, [0.0, 0.0], {}
        self._changed = anyio.Event()
        game.reset(seed)

    async def wait_turn(self, seat: int) -> str | None:
        """The seat's new observation once it is its move; None once the game is over."""
        while not self.done and self.game.current_seat() != seat:
            await self._changed.wait()
        if self.error is not None:
            raise EpisodeError(f"the self-play match was aborted: {self.error}")
        return None if self.done else self.game.observe(seat)

    def act(self, seat: int, text: str) -> None:
        over = self.game.act(text)
        self.moves += 1
        self.invalid[seat] += int(bool(getattr(self.game, "last_invalid", False)))
        if over:
            self.rewards, self.info = self.game.outcome()
            self.invalid[seat] += int(self.info.get("invalid", [False, False])[seat])
        elif self.moves >= self.max_moves:
            self.info = {"reason": f"move limit {self.max_moves} reached: a draw"}
        self.done = over or self.moves >= self.max_moves
        self._notify()

    def abort(self, reason: str) -> None:
        if not self.done:
            self.done, self.error = True, reason
            self._notify()

    def _notify(self) -> None:
        changed, self._changed = self._changed, anyio.Event()
        changed.set()


async def play_seat(match: Match, seat: int, engine, tokenizer, sampling, *,
                    system: str | None = None) -> Rollout | None:
    """Play ``seat`` of ``match`` to the end with ``engine``; ``sampling(turn)`` gives each
    turn's SamplingParams. The Rollout holds the seat's exact tokens; its metadata the seat, its
    reward, the outcome and the number of its invalid moves. None when the game ended before the
    seat's first move (the other seat lost on invalid moves at once): it has no tokens."""
    state, turn = None, 0
    try:
        while (observation := await match.wait_turn(seat)) is not None:
            message = [{"role": "user", "content": observation or "(your move)"}]
            state = (EpisodeState.start(tokenizer, message, system=system) if state is None
                     else append_turn(tokenizer, state, message))
            step = await sample_turn(engine, tokenizer, state.ids, sampling(turn))
            step = dc_replace(step, metadata={**step.metadata, "seat": seat, "move": match.moves})
            state = dc_replace(state, ids=state.ids + step.token_ids, steps=state.steps + [step],
                               messages=state.messages + [{"role": "assistant", "content": step.text}])
            match.act(seat, step.text)
            turn += 1
    except BaseException as exc:
        match.abort(f"seat {seat} failed: {type(exc).__name__}: {exc}")
        raise
    if state is None:
        return None
    rollout = dc_replace(state, done=True).to_rollout()
    reward = match.rewards[seat]
    rollout.metadata.update(seat=seat, reward=reward, moves=turn, invalid_moves=match.invalid[seat],
                            outcome="win" if reward > 0 else "loss" if reward < 0 else "draw",
                            reason=match.info.get("reason", ""))
    return rollout


def game_outcome(*, rollouts, **_) -> list[float]:
    """The reward of a self-play episode: its seat's game outcome (win 1, draw 0, loss -1 for
    textarena's zero-sum games)."""
    return [float(r.metadata.get("reward", 0.0)) for r in rollouts]


async def play_games(agent, opponent, game, n: int, *, seed: int = 0, max_new_tokens: int = 16,
                     temperature: float = 1.0, max_moves: int = 18, system: str | None = None) -> list[dict]:
    """``n`` games of ``agent`` against ``opponent`` (materl Agents), concurrently, ``agent``
    taking seat ``i % 2`` in game ``i`` (seeded ``seed + i``): what an evaluation of a trained
    policy against its starting weights plays. Each dict: ``seat``, ``reward``, ``outcome`` (of
    ``agent``), ``invalid_moves`` (both seats), ``reason``."""
    from materl.engines.base import SamplingParams

    out: list[dict] = [{} for _ in range(n)]

    def params(i: int, who: int):
        return lambda t: SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                                        seed=(seed * 1_000_003 + i * 7919 + who * 104_729 + t) % (2**63 - 1))

    async def one(i: int) -> None:
        match, seat = Match(make_game(game), seed=seed + i, max_moves=max_moves), i % 2

        async def theirs() -> None:
            await play_seat(match, 1 - seat, opponent.engine, opponent.tokenizer, params(i, 1), system=system)

        async with anyio.create_task_group() as tg:
            tg.start_soon(theirs)
            await play_seat(match, seat, agent.engine, agent.tokenizer, params(i, 0), system=system)
        reward = match.rewards[seat]
        out[i] = {"seat": seat, "reward": reward, "outcome": "win" if reward > 0 else "loss" if reward < 0 else "draw",
                  "invalid_moves": list(match.invalid), "reason": match.info.get("reason", "")}

    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(one, i)
    return out
