"""Decode speed: the Mojo engine vs the transformers engine vs HF ``generate``, SmolLM2-135M on CPU;
and the Mojo engine's sampling log-probs vs a teacher-forced torch recomputation.

Speed. For each batch size (``--batches``, default 1 and 8) and number of new tokens
(``--new-tokens``, default 32 and 64): B chat prompts (SmolLM2's chat template, distinct short
questions), sampled at temperature 1 (no top-k/top-p), every row producing exactly N tokens
(HF: ``min_new_tokens=N``; engines: eos ids emptied, so a sampled eos does not stop a row; the
work per row is the same either way). The Mojo engine computes the prompts' shared prefix (the
chat template's system turn) once within a call, and keeps nothing across calls. Timed: the wall time of the whole call (prefill, decode,
sampling, Python) for ``generate`` on a left-padded batch, and for B concurrent
``engine.generate`` calls. tokens/s = B * N / time. The three run alternately for ``--rounds``
rounds after one warm-up round. Two tables: the best round of each (the run least disturbed by
other processes on a shared machine) and the medians, each with the ratios.

All torch work runs in this process's main thread (``materl.compute.serving``: one OpenMP pool,
as in training), with ``torch.set_num_threads(--threads)``; the Mojo engine runs ``--threads``
threads of its own forward.

Numerics. For the batch-8 x 64-token rows the Mojo engine sampled (and, for comparison, the
transformers engine's rows), every token's sampling log-prob vs the learner's recomputation:
one unpadded teacher-forced forward of prompt + completion, log_softmax(logits / T)
(``materl.engines.numerics``). Reported: mean and max |delta| over all tokens.

    python benchmarks/decode.py --threads 2 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import threading
import time
from concurrent.futures import Future

import torch

from materl import compute
from materl.engines.base import SamplingParams
from materl.engines.models import load_model
from materl.engines.numerics import logprob_delta, teacher_forced_logprobs

MODEL = "smollm2-135m-instruct"
QUESTIONS = ["Write a short poem about the sea.", "Explain what a CPU does.", "Give me three fruit names.",
             "Describe your favourite season.", "Tell me a fun fact about cats.", "What is a good breakfast?",
             "Summarise why sleep matters.", "Name a famous scientist and say why."]


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                                            add_generation_prompt=True, tokenize=True)
        out.append([int(t) for t in (ids["input_ids"] if hasattr(ids, "keys") else ids)])
    return out


def hf_generate(model, tokenizer, prompts: list[list[int]], new_tokens: int) -> float:
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=pad)
    elapsed = time.perf_counter() - start
    assert out.shape[1] - width == new_tokens
    return elapsed


def engine_generate(engine, prompts: list[list[int]], new_tokens: int, seed: int) -> tuple[float, list]:
    pool = getattr(engine, "pool", None)
    if pool is not None:  # every call starts cold, as generate() does: no prompt kept from the last round
        pool.clear()

    async def run():
        params = [SamplingParams(max_new_tokens=new_tokens, seed=seed + i) for i in range(len(prompts))]
        return await asyncio.gather(*[engine.generate(p, q) for p, q in zip(prompts, params)])

    start = time.perf_counter()
    gens = on_loop_thread(run)
    elapsed = time.perf_counter() - start
    assert all(len(g.token_ids) == new_tokens for g in gens)
    return elapsed, gens


def on_loop_thread(make_coro):
    """Run an event loop in a helper thread while this thread serves the compute work."""
    future: Future = Future()

    def main():
        try:
            future.set_result(asyncio.run(make_coro()))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            future.set_exception(exc)

    with compute.serving() as here:
        threading.Thread(target=main, daemon=True).start()
        return here.until(future)


def make_engines(model, tokenizer, threads: int):
    from materl.engines.mojo_engine import MojoEngine
    from materl.engines.transformers_engine import TransformersEngine

    engines = {"transformers engine": TransformersEngine(model, tokenizer),
               "mojo engine": MojoEngine(model, tokenizer, threads=threads)}
    for e in engines.values():
        e.eos_ids = frozenset()  # every row runs its N tokens (see the module docstring)
    return engines


def speed(model, tokenizer, engines, batches, new_tokens_list, rounds: int) -> list[dict]:
    rows = []
    for batch in batches:
        prompts = chat_prompts(tokenizer, batch)
        for n in new_tokens_list:
            times: dict[str, list[float]] = {"HF generate": [], **{k: [] for k in engines}}
            for r in range(rounds + 1):  # round 0 warms up
                t = {"HF generate": hf_generate(model, tokenizer, prompts, n)}
                for name, engine in engines.items():
                    t[name] = engine_generate(engine, prompts, n, seed=1000 * r)[0]
                if r:
                    for k, v in t.items():
                        times[k].append(v)
            best = {k: batch * n / min(v) for k, v in times.items()}
            median = {k: batch * n / statistics.median(v) for k, v in times.items()}
            rows.append({"batch": batch, "new": n, "best": best, "median": median})
            print(f"batch {batch} x {n}: " + ", ".join(f"{k} {best[k]:.1f} (median {median[k]:.1f}) tok/s"
                                                       for k in times), flush=True)
    return rows


def print_table(rows: list[dict], which: str) -> None:
    print(f"\n| batch | new tokens | HF generate | transformers engine | mojo engine | mojo / HF | mojo / transformers |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        r = row[which]
        print(f"| {row['batch']} | {row['new']} | {r['HF generate']:.1f} | {r['transformers engine']:.1f} | "
              f"{r['mojo engine']:.1f} | {r['mojo engine'] / r['HF generate']:.2f}x | "
              f"{r['mojo engine'] / r['transformers engine']:.2f}x |")
    print(f"(tokens/s, {which} of alternating rounds)")


def numerics(model, tokenizer, engines, batch: int, n: int) -> dict[str, tuple[float, float, int]]:
    prompts = chat_prompts(tokenizer, batch)
    out = {}
    for name, engine in engines.items():
        _, gens = engine_generate(engine, prompts, n, seed=7)
        sampled = [torch.tensor(g.logprobs, dtype=torch.float64) for g in gens]
        ref = [teacher_forced_logprobs(model, p, g.token_ids, temperature=1.0) for p, g in zip(prompts, gens)]
        d = logprob_delta(torch.nn.utils.rnn.pad_sequence(sampled, batch_first=True),
                          torch.nn.utils.rnn.pad_sequence(ref, batch_first=True),
                          torch.nn.utils.rnn.pad_sequence([torch.ones(len(g.token_ids)) for g in gens], batch_first=True))
        out[name] = (d.mean, d.max, d.tokens)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--new-tokens", type=int, nargs="+", default=[32, 64])
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(MODEL)
    model.eval()
    engines = make_engines(model, tokenizer, args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, python {sys.version.split()[0]}\n", flush=True)
    rows = speed(model, tokenizer, engines, args.batches, args.new_tokens, args.rounds)
    print_table(rows, "best")
    print_table(rows, "median")
    mojo = engines["mojo engine"].forward.chooser.used
    print(f"mojo engine forward calls by thread count: {mojo}\n")
    batch, n = max(args.batches), max(args.new_tokens)
    print(f"| engine | sampling log-prob vs teacher-forced recomputation, {batch} x {n} tokens | mean abs delta "
          f"| max abs delta |")
    print("|---|---|---|---|")
    for name, (mean, mx, tokens) in numerics(model, tokenizer, engines, batch, n).items():
        print(f"| {name} | {tokens} tokens | {mean:.2e} | {mx:.2e} |")


if __name__ == "__main__":
    main()
