"""Self-play RL on a two-player text game: SmolLM2-135M-Instruct plays both seats of textarena's
TicTacToe, each seat's turns an episode of its own, rewarded by the game's outcome; then the
trained policy plays its own starting weights.

    python examples/self_play.py                      # SmolLM2 on 2 CPU cores (minutes)
    python examples/self_play.py --frozen-opponent    # train against the starting weights instead
    python examples/self_play.py --refresh-opponent-every 5   # ... against the policy of up to 5 steps ago
    python examples/self_play.py --tiny               # the tiny random model, 2 steps (CI)

The game comes from textarena (the ``envs`` extra), offline: a seat writes its move as ``[4]``;
an invalid move is answered with the reason and may be retried once, a second one in a row loses
the game (textarena's rule). A group of ``group_size`` episodes is ``group_size / 2`` games from
the same opening; GRPO's baseline runs over both seats of them (``recipes/self_play.py``).

Printed: one line per step (mean outcome, wins/draws/losses and invalid moves of the step's
episodes), then as JSON on the last line the evaluation: ``eval_games`` games of the trained
policy against its starting weights, seats alternating, sampled at temperature 1; ``score`` is
(wins + draws / 2) / games, with its 95% Wilson interval.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from functools import partial

os.environ.setdefault("OMP_NUM_THREADS", "2")

import anyio  # noqa: E402

import materl as ml  # noqa: E402
from materl.recipes.self_play import refresh_opponent, self_play_recipe  # noqa: E402
from materl.rollout.self_play import play_games  # noqa: E402


def wilson(k: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a proportion k/n (Wilson 1927); (0, 1) when n is 0."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (centre - half) / (1 + z * z / n), (centre + half) / (1 + z * z / n)


def run(*, game: str = "TicTacToe-v0", model: str = "smollm2-135m-instruct", steps: int = 20, batch_size: int = 2,
        group_size: int = 4, max_new_tokens: int = 12, lr: float = 2e-5, seed: int = 0, frozen_opponent: bool = False,
        eval_games: int = 32, max_moves: int = 18, run_dir: str = "runs/self_play", progress: bool = False,
        refresh_opponent_every: int = 0) -> dict:
    """Train ``steps`` steps and return the evaluation against the starting weights. ``game``: a
    textarena id, or a factory of a ``materl.rollout.self_play.TwoPlayerGame``.
    ``refresh_opponent_every``: K > 0 trains against an opponent that is the policy's copy of up
    to K steps ago (``refresh_opponent``); the evaluation is always against the starting weights."""
    policy, start = ml.Agent(model, trainable=True), ml.Agent(model)
    frozen_opponent = frozen_opponent or refresh_opponent_every > 0
    opponent = ml.Agent(model) if refresh_opponent_every > 0 else start

    def on_step(n: int, m: dict) -> None:
        _print_step(n, m)
        if refresh_opponent_every > 0 and n % refresh_opponent_every == 0:
            refresh_opponent(policy, opponent)

    factory = partial(ml.TextArenaGame, game) if isinstance(game, str) else game
    game = game if isinstance(game, str) else getattr(game, "__name__", repr(game))
    recipe = self_play_recipe(factory, opponent=frozen_opponent, max_moves=max_moves)
    agents = {"policy": policy, **({"opponent": opponent} if frozen_opponent else {})}
    step = ml.compile(recipe, **agents, group_size=group_size, max_new_tokens=max_new_tokens, lr=lr,
                      temperature=1.0, seed=seed, episode_timeout_s=3600.0)  # a game is up to max_moves turns
    rows = [{"prompt": f"{game} opening {k}", "game_seed": seed * 10_000 + k} for k in range(256)]
    try:
        result = ml.train(step, rows, steps=steps, batch_size=batch_size, seed=seed, run_dir=run_dir,
                          progress=progress, tensorboard=False, on_step=on_step)
    finally:
        step.close()
    games = anyio.run(partial(play_games, policy, start, factory, eval_games, seed=10_000 + seed,
                              max_new_tokens=max_new_tokens, max_moves=max_moves))
    wins = sum(g["outcome"] == "win" for g in games)
    draws = sum(g["outcome"] == "draw" for g in games)
    score = (wins + draws / 2) / max(1, len(games))
    low, high = wilson(wins + draws / 2, len(games))
    return {"game": game, "model": model, "steps": steps, "seed": seed, "frozen_opponent": frozen_opponent,
            "trained_tokens": sum(h["tokens"] for h in result["history"]), "eval_games": len(games),
            "wins": wins, "draws": draws, "losses": len(games) - wins - draws, "score": score,
            "score_ci95": [low, high], "history": result["history"]}


def _print_step(step: int, m: dict) -> None:
    print(f"step {step - 1} outcome {m.get('reward/game/mean', float('nan')):+.3f} "
          f"win {m.get('self_play/win/mean', 0):.2f} draw {m.get('self_play/draw/mean', 0):.2f} "
          f"loss {m.get('self_play/loss/mean', 0):.2f} invalid {m.get('self_play/invalid_moves/mean', 0):.2f} "
          f"failed {m.get('failed_episodes', 0):.0f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--game", default="TicTacToe-v0")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-games", type=int, default=32)
    p.add_argument("--frozen-opponent", action="store_true", help="train against the starting weights")
    p.add_argument("--refresh-opponent-every", type=int, default=0, metavar="K",
                   help="train against the policy's copy of up to K steps ago")
    p.add_argument("--run-dir", default="runs/self_play")
    p.add_argument("--tiny", action="store_true", help="the tiny random model, 2 steps (a smoke run for CI)")
    args = p.parse_args(argv)
    kw = dict(game=args.game, steps=args.steps, seed=args.seed, eval_games=args.eval_games,
              frozen_opponent=args.frozen_opponent, run_dir=args.run_dir,
              refresh_opponent_every=args.refresh_opponent_every)
    if args.tiny:
        kw.update(model="tiny-random", steps=2, batch_size=2, group_size=2, max_new_tokens=4, lr=1e-3,
                  eval_games=4, max_moves=6)
    result = run(**kw)
    print(json.dumps({k: v for k, v in result.items() if k != "history"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
