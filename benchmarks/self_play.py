"""Self-play: the trained policy's score against its starting weights after N steps
(issue 35's self-play benchmark). Goal: above 50%.

    python benchmarks/self_play.py                             # SmolLM2-135M, 3 seeds
    python benchmarks/self_play.py --model tiny-random --game longer-move --steps 20 --lr 1e-3

Per seed: ``examples/self_play.py``'s run (both seats trained on textarena TicTacToe, GRPO over
a group's episodes), then ``eval_games`` games of the trained policy against the starting
weights, seats alternating, sampled at temperature 1. Score = (wins + draws / 2) / games, with
its 95% Wilson interval; the last line pools every seed's games. One run on a machine shared
with other work: the figures are what this run measured, not a mean over runs.

``--game longer-move`` is a toy game for the tiny random model, which never writes a TicTacToe
move (random bytes): two moves each, the seat that wrote more characters in all wins. It checks
that the self-play machinery (per-seat episodes, rewards, group credit) improves a policy
against its starting weights where the model can learn the game at all; it says nothing about
SmolLM2 or TicTacToe.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import self_play as example  # noqa: E402

import materl as ml  # noqa: E402


class LongerMove:
    """Two moves each; the seat whose moves hold more characters wins (1 / -1), a tie is a draw."""

    def reset(self, seed):
        self.moves, self.seen = [], [0, 0]

    def current_seat(self):
        return len(self.moves) % 2

    def observe(self, seat):
        new, self.seen[seat] = self.moves[self.seen[seat]:], len(self.moves)
        return "Write more than your opponent." + "".join(f"\nPlayer {s}: {t}" for s, t in new)

    def act(self, text):
        self.moves.append((self.current_seat(), text))
        return len(self.moves) == 4

    def outcome(self):
        a, b = (sum(len(t) for s, t in self.moves if s == k) for k in (0, 1))
        return [float((a > b) - (a < b)), float((b > a) - (b < a))], {"reason": f"{a} vs {b} characters"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--game", default="TicTacToe-v0", help="a textarena id, or longer-move (a toy game, see above)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--eval-games", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--frozen-opponent", action="store_true")
    p.add_argument("--error-allowance", type=int, default=None,
                   help="invalid moves in a row a seat may retry (textarena's default: 1)")
    p.add_argument("--run-dir", default="runs/bench_self_play")
    args = p.parse_args(argv)
    total = {"games": 0, "points": 0.0}
    for seed in args.seeds:
        t0 = time.perf_counter()
        game = LongerMove if args.game == "longer-move" else args.game
        if args.error_allowance is not None and isinstance(game, str):
            game = partial(ml.TextArenaGame, game, error_allowance=args.error_allowance)
        r = example.run(game=game, model=args.model, steps=args.steps, seed=seed, eval_games=args.eval_games,
                        batch_size=args.batch_size, group_size=args.group_size, max_new_tokens=args.max_new_tokens,
                        lr=args.lr, frozen_opponent=args.frozen_opponent, run_dir=f"{args.run_dir}/seed{seed}")
        total["games"] += r["eval_games"]
        total["points"] += r["wins"] + r["draws"] / 2
        print(f"seed {seed}: score {r['score']:.3f} 95% CI [{r['score_ci95'][0]:.3f}, {r['score_ci95'][1]:.3f}] "
              f"(W/D/L {r['wins']}/{r['draws']}/{r['losses']} of {r['eval_games']}) after {args.steps} steps, "
              f"{r['trained_tokens']:.0f} trained tokens, {time.perf_counter() - t0:.0f} s", flush=True)
    n, k = total["games"], total["points"]
    low, high = example.wilson(k, n)
    print(json.dumps({"model": args.model, "game": args.game, "steps": args.steps, "seeds": args.seeds, "games": n,
                      "score": k / max(1, n), "score_ci95": [low, high]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
