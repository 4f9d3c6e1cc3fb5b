"""An agentic rollout on the transformers engine: many concurrent multi-turn episodes with a
scripted tool between turns, the device loop vs the current loop (a row of the GPU check).

    python benchmarks/agentic_rollout.py --shape tiny --episodes 8     # CPU: uncaptured, small

Each episode: ``turns`` model turns of exactly ``new_tokens`` tokens (eos off), a scripted tool
of ``tool_s`` latency after each but the last, whose result (a chat ``tool`` message and the next
assistant header, as the chat template renders them) extends the episode's ids. Reported per
engine: rollout wall, sampled tok/s, and per later turn the prompt tokens prefilled vs the
tokens new since the previous turn (tool result + template + the last sampled token, which the
previous turn sampled but never fed): the device loop keeps each episode's cache across turns.
One warm-up rollout each (captures / compiles), kept caches dropped, then one timed rollout.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch

from gpu_check import ENGINE_RUNS, SHAPES, Report, chat_prompts, quiet_engine, random_model, sync, tokenizer_for


def agentic_rows(report: Report, shape: str, device, tokenizer, *, episodes: int, turns: int, new_tokens: int,
                 tool_s: float) -> None:
    """``episodes`` concurrent episodes of ``turns`` model turns (``new_tokens`` each, eos off),
    a scripted tool of ``tool_s`` latency between turns whose result (rendered as a chat ``tool``
    message) extends the episode; the device loop vs the current loop on one model: rollout wall,
    sampled tok/s, and per later turn the prompt tokens prefilled vs the tokens new since the
    previous turn (tool result + template; the last sampled token is fed too)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = random_model(shape, device, dtype)
    walls = {}
    for name in ("materl device loop (graph)", "materl current loop"):
        def one(name=name):
            engine = quiet_engine(model, tokenizer, episodes, **ENGINE_RUNS[name])
            asyncio.run(agentic_rollout(engine, tokenizer, episodes, turns, new_tokens, tool_s))  # warm-up
            engine.sync_weights()  # a new step: kept caches are stale
            wall, tokens, later = asyncio.run(agentic_rollout(engine, tokenizer, episodes, turns, new_tokens, tool_s))
            walls[name] = wall
            prefilled, new = sum(p for p, _ in later), sum(n for _, n in later)
            report.add("agentic", f"{shape} {episodes} x {turns} turns, {tool_s * 1000:.0f} ms tool: {name}",
                       f"{wall:.2f} s rollout, {tokens / wall:,.0f} tok/s; later turns prefilled {prefilled} "
                       f"tokens for {new} new ({prefilled / max(1, new):.3f}x)" if prefilled else
                       f"{wall:.2f} s rollout, {tokens / wall:,.0f} tok/s")
        report.guarded("agentic", f"{shape}: {name}", one, needs_s=10 if device.type == "cpu" else 45)
    if len(walls) == 2:
        report.add("agentic", f"{shape}: current / device loop rollout wall",
                   f"{walls['materl current loop'] / walls['materl device loop (graph)']:.2f}x")
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()


async def agentic_rollout(engine, tokenizer, episodes: int, turns: int, new_tokens: int, tool_s: float):
    """(wall s, sampled tokens, [(prefilled, new) per later turn]) of one scripted rollout."""
    from materl.engines.base import SamplingParams

    prompts = chat_prompts(tokenizer, episodes)
    later: list[tuple[int, int]] = []

    async def episode(i: int) -> int:
        ids, made, new = list(prompts[i]), 0, 0
        for turn in range(turns):
            gen = await engine.generate(ids, SamplingParams(max_new_tokens=new_tokens, temperature=1.0,
                                                            seed=1000 * i + turn))
            made += len(gen.token_ids)
            if turn:
                later.append((gen.metadata.get("prefilled", 0), new))
            if turn == turns - 1:
                return made
            await asyncio.sleep(tool_s)  # the scripted tool
            result = tool_message(tokenizer, f"result {i}.{turn}: {(i + 1) * (turn + 7)}")
            ids = ids + gen.token_ids + result
            new = len(result) + 1
        return made

    sync(next(engine.model.parameters()).device)
    t0 = time.perf_counter()
    made = await asyncio.gather(*(episode(i) for i in range(episodes)))
    sync(next(engine.model.parameters()).device)
    return time.perf_counter() - t0, sum(made), later


def tool_message(tokenizer, text: str) -> list[int]:
    """A tool result as the chat template renders it after an assistant turn, then the next
    assistant header."""
    out = tokenizer.apply_chat_template([{"role": "tool", "content": text}], add_generation_prompt=True, tokenize=True)
    return [int(t) for t in (out["input_ids"] if hasattr(out, "keys") else out)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--tool-s", type=float, default=0.05)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    report = Report(budget_s=float("inf"))
    agentic_rows(report, args.shape, device, tokenizer_for(SHAPES[args.shape]["vocab_size"]), episodes=args.episodes,
                 turns=args.turns, new_tokens=args.new_tokens, tool_s=args.tool_s)
    print(report.summary())


if __name__ == "__main__":
    main()
