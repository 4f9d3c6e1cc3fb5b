"""Self-play (``ml.self_play``, ``materl.rollout.self_play``): textarena's TicTacToe rules checked by
hand, each seat an episode with its own reward and exact tokens, the frozen opponent never
updated, invalid moves as the game's rule."""

import anyio
import pytest
import torch

import materl as ml
from materl.engines.base import SamplingParams
from materl.recipes.self_play import self_play_recipe
from materl.rollout.self_play import Match, TextArenaGame, play_seat

pytest.importorskip("textarena")


def test_tictactoe_rules_hand_checked():
    game = TextArenaGame("TicTacToe-v0")
    game.reset(0)
    assert game.current_seat() == 0 and "Tic Tac Toe" in game.observe(0)
    # O at 0, X at 3, O at 1, X at 4, O at 2: the top row is O's, seat 0 wins
    for seat, move in [(0, "[0]"), (1, "[3]"), (0, "[1]"), (1, "[4]")]:
        assert game.current_seat() == seat and game.act(f"I play {move}") is False and not game.last_invalid
    assert "[3]" in game.observe(0)  # seat 0 is shown seat 1's moves
    assert game.act("[2]") is True
    rewards, info = game.outcome()
    assert rewards == [1.0, -1.0] and info["invalid"] == [False, False]


def test_a_full_board_without_a_line_is_a_draw():
    game = TextArenaGame("TicTacToe-v0")
    game.reset(1)
    # O X O / O X X / X O O  (cells 0..8 by seat): no three in a row
    moves = ["[0]", "[1]", "[2]", "[4]", "[3]", "[5]", "[7]", "[6]", "[8]"]
    over = [game.act(m) for m in moves]
    assert over == [False] * 8 + [True]
    assert game.outcome()[0] == [0.0, 0.0]


def test_an_invalid_move_is_told_and_retried_once_then_loses():
    game = TextArenaGame("TicTacToe-v0")
    game.reset(0)
    assert game.act("[4]") is False
    assert game.act("[4]") is False and game.last_invalid and game.current_seat() == 1  # occupied: retry
    assert "invalid move" in game.observe(1)
    assert game.act("no move here") is True  # the second invalid move in a row loses
    rewards, info = game.outcome()
    assert rewards == [1.0, -1.0] and info["invalid"] == [False, True]

    strict = TextArenaGame("TicTacToe-v0", error_allowance=0)
    strict.reset(0)
    assert strict.act("[12]") is True and strict.outcome()[0] == [-1.0, 1.0]


def test_bad_games_are_clear_errors():
    with pytest.raises(LookupError, match="unknown textarena game 'TicTacToo-v0'.*did you mean 'TicTacToe-v0'"):
        TextArenaGame("TicTacToo-v0")
    with pytest.raises(ValueError, match="error_allowance.*got -1"):
        TextArenaGame("TicTacToe-v0", error_allowance=-1)

    with pytest.raises(ValueError, match="names the policy 'policy' itself"):
        @ml.recipe
        def itself(policy, prompts):
            ml.self_play(policy, prompts, opponent=policy)
    with pytest.raises(ml.CompileError, match="even group_size.*got group_size=3"):  # when compiled, not run
        ml.compile(self_play_recipe(LongerMove), policy=ml.Agent("tiny-random", trainable=True), group_size=3,
                   max_new_tokens=2, max_failed_fraction=1.0)


class LongerMove:
    """Two moves each; the seat that wrote more characters in all wins (1 / -1), a tie is a draw.
    Any text is a valid move, so the tiny random model plays whole games."""

    made: list = []

    def __init__(self):
        LongerMove.made.append(self)

    def reset(self, seed):
        self.moves, self.seen = [], [0, 0]

    def current_seat(self):
        return len(self.moves) % 2

    def observe(self, seat):
        new, self.seen[seat] = self.moves[self.seen[seat]:], len(self.moves)
        return "Write a move." + "".join(f"\nseat {s} wrote {t!r}" for s, t in new)

    def act(self, text):
        self.moves.append((self.current_seat(), text))
        return len(self.moves) == 4

    def outcome(self):
        a, b = (sum(len(t) for s, t in self.moves if s == k) for k in (0, 1))
        win = (a > b) - (a < b)
        return [float(win), float(-win)], {"reason": f"{a} vs {b} characters"}


def _step(opponent=None, **kw):
    agents = {"policy": ml.Agent("tiny-random", trainable=True), **({"opponent": opponent} if opponent else {})}
    return ml.compile(self_play_recipe(LongerMove, opponent=opponent is not None), **agents,
                      max_new_tokens=5, seed=3, **kw)


def test_each_seat_is_an_episode_with_its_own_reward_and_exact_tokens():
    LongerMove.made.clear()
    step, seen = _step(group_size=4), []
    try:
        metrics = step.run(prompts=["opening"], on_episode=seen.append)
    finally:
        step.close()
    assert len(LongerMove.made) == 2 and metrics["failed_episodes"] == 0.0  # 4 episodes: 2 games x 2 seats
    seen.sort(key=lambda e: e.index)
    rollouts = [e.rollout("rollout") for e in seen]
    assert [r.metadata["seat"] for r in rollouts] == [0, 1, 0, 1]
    policy = step.agents["policy"]
    for game, (seat0, seat1) in zip(LongerMove.made, (rollouts[:2], rollouts[2:])):
        a, b = (sum(len(t) for s, t in game.moves if s == k) for k in (0, 1))
        assert seat0.metadata["reward"] == (a > b) - (a < b) == -seat1.metadata["reward"]
        for seat, r in ((0, seat0), (1, seat1)):  # the seat's own moves are its trained turns, in order
            assert [s.text for s in r.generate_steps] == [t for s_, t in game.moves if s_ == seat]
            assert all(s.metadata["seat"] == seat for s in r.generate_steps)
    for ep, r in zip(seen, rollouts):  # each turn: exactly what the engine samples from the ids before it
        ids = list(r.prompt_ids)
        for k, s in enumerate(r.steps):
            if s.kind == "generate":
                params = SamplingParams(max_new_tokens=5, temperature=1.0, seed=(ep.seed * 1009 + (k // 2) * 7919))
                again = anyio.run(policy.engine.generate, ids, params)
                assert list(again.token_ids) == s.token_ids
            ids += s.token_ids
    rewards = torch.tensor([r.metadata["reward"] for r in rollouts], dtype=torch.float64)
    assert metrics["reward/game/mean"] == pytest.approx(float(rewards.mean()))  # the group: both seats
    if rewards.std() > 0:  # GRPO over all four episodes: (r - mean) / std on every trained token
        expected = (rewards - rewards.mean()) / rewards.std()
        for ep, want in zip(seen, expected):
            mask = torch.as_tensor(ep.rollout("rollout").loss_mask, dtype=torch.bool)
            got = ep.resolve("advantages").reshape(-1)[: len(mask)][mask]  # padded to the batch's length
            assert torch.allclose(got.double(), torch.full_like(got.double(), float(want)), atol=1e-5)


def test_a_frozen_opponent_is_never_updated():
    opponent = ml.Agent("tiny-random")
    before = {k: v.clone() for k, v in opponent.model.state_dict().items()}
    LongerMove.made.clear()
    step, seen = _step(opponent=opponent, group_size=2, lr=1e-2), []
    policy = step.agents["policy"]
    start = {k: v.clone() for k, v in policy.model.state_dict().items()}
    try:
        for _ in range(2):
            step.run(prompts=["opening"], on_episode=seen.append)
    finally:
        step.close()
    assert any(not torch.equal(start[k], v) for k, v in policy.model.state_dict().items())
    assert all(torch.equal(before[k], v) for k, v in opponent.model.state_dict().items())
    assert len(LongerMove.made) == 4  # one game per episode
    for ep in seen:  # the policy's seat alternates; only its own moves are in its episode
        r = ep.rollout("rollout")
        seat = ep.index % 2
        game = next(g for g in LongerMove.made if [t for s, t in g.moves if s == seat] == [x.text for x in r.generate_steps])
        assert r.metadata["seat"] == seat and len(r.generate_steps) == 2 and len(game.moves) == 4


def test_invalid_moves_through_a_step_lose_the_game_and_never_crash():
    step, seen = ml.compile(self_play_recipe("TicTacToe-v0"), policy=ml.Agent("tiny-random", trainable=True),
                            group_size=2, max_new_tokens=3, seed=0), []
    try:
        metrics = step.run(prompts=["opening"], on_episode=seen.append)
    finally:
        step.close()
    seen.sort(key=lambda e: e.index)
    first = seen[0].rollout("rollout")  # random bytes are never '[n]': told, retried, then lost
    assert first.metadata["outcome"] == "loss" and first.metadata["invalid_moves"] == 2
    assert len(first.generate_steps) == 2 and "invalid move" in first.steps[1].text
    assert metrics["self_play/loss/mean"] == 1.0 and metrics["self_play/invalid_moves/mean"] == 2.0
    assert "seat 1 never moved" in str(seen[1].error)  # nothing to train: the episode fails, the step goes on


def test_a_failed_seat_aborts_its_partner_instead_of_hanging():
    class Broken:
        async def generate(self, ids, params):
            raise RuntimeError("engine down")

    agent = ml.Agent("tiny-random")

    async def main():
        match = Match(LongerMove(), seed=0, max_moves=4)
        errors = []

        async def seat(n, engine):
            try:
                await play_seat(match, n, engine, agent.tokenizer, lambda t: SamplingParams(max_new_tokens=2, seed=t))
            except Exception as e:  # noqa: BLE001 - recorded for the assertions
                errors.append((n, e))

        async with anyio.create_task_group() as tg:
            tg.start_soon(seat, 0, agent.engine)
            tg.start_soon(seat, 1, Broken())
        return errors

    errors = dict(anyio.run(main))
    assert "engine down" in str(errors[1]) and "aborted: seat 1 failed: RuntimeError: engine down" in str(errors[0])


def test_refresh_opponent_makes_an_earlier_copy_that_later_updates_do_not_reach():
    from materl.recipes.self_play import refresh_opponent

    opponent = ml.Agent("tiny-random")
    step = _step(opponent=opponent, group_size=2, lr=1e-2)
    policy = step.agents["policy"]
    try:
        step.run(prompts=["opening"])
        refresh_opponent(policy, opponent)
        copy = {k: v.clone() for k, v in opponent.model.state_dict().items()}
        assert all(torch.equal(copy[k], v) for k, v in policy.model.state_dict().items())
        step.run(prompts=["opening"])
    finally:
        step.close()
    assert any(not torch.equal(copy[k], v) for k, v in policy.model.state_dict().items())
    assert all(torch.equal(copy[k], v) for k, v in opponent.model.state_dict().items())
    with pytest.raises(ValueError, match="refresh_opponent: the opponent 'tiny-random' is not the same model"):
        refresh_opponent(ml.Agent("tiny-random", trainable=True, lora=dict(r=4)), opponent)


def test_a_seat_that_arrives_after_its_game_ended_finds_it_over():
    from materl.compiler.context import StageEnv
    from materl.compiler.episode import Episode
    from materl.compiler.kinds.self_play import self_play_episode

    step = ml.compile(self_play_recipe("TicTacToe-v0"), policy=ml.Agent("tiny-random", trainable=True),
                      group_size=2, max_new_tokens=3)
    run = StageEnv(step.context(), step.agents)
    node = next(n for n in step.recipe.nodes if n.op == "self_play")
    first, second = (Episode(j, 0, 0, "opening", {}, seed=j) for j in range(2))

    async def one_after_the_other():  # seat 0 plays alone and loses on invalid moves; then seat 1 comes
        lost = await self_play_episode(run, node, first, None)
        with pytest.raises(ml.EpisodeError, match="seat 1 never moved"):
            await self_play_episode(run, node, second, None)
        return lost

    try:
        assert anyio.run(one_after_the_other).metadata["outcome"] == "loss"
    finally:
        step.close()
    with pytest.raises(ml.CompileError, match="needs max_concurrent_episodes >= 2.*got 1"):
        ml.compile(self_play_recipe("TicTacToe-v0"), policy=ml.Agent("tiny-random", trainable=True),
                   group_size=2, max_new_tokens=3, max_concurrent_episodes=1)
