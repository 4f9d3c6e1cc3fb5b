"""The one prepared GPU check (issue #28): materl's GPU tests and GPU benchmarks, one summary.

    python benchmarks/gpu_check.py                    # on the GPU machine: at most ~9 minutes
    python benchmarks/gpu_check.py --dry-run          # CPU smoke run, tiny shapes (CI runs this)

Pieces, in this order (what the issue's goals need first), each timed against one overall budget
(``--budget-s``, default 430 s: no piece starts past it; ``--out`` is rewritten after every row)
and each robust to a missing optional piece (TRL absent, a compile failing): its rows then say
why, the rest runs.

1. decode tok/s, Llama-shaped models from configs with random weights (the 1.4B shape: hidden
   1536, 28 layers, GQA 12/2, MLP 8960; the SmolLM2-135M shape; vocabulary 49152), bf16, 128 new
   tokens, temperature 1, every row exactly N tokens (eos off), batch 8: HF static cache
   (+ torch.compile, which ``generate`` turns on for a static cache on CUDA), materl's current
   loop (``device_loop=False``) and its device loop (raw CUDA graphs). One warm-up call each
   (compiles, captures), then timed.
2. an agentic rollout, 1.4B shape: 64 concurrent episodes of 3 turns (64 tokens each) with a
   scripted tool of 50 ms between turns whose result extends the episode: rollout wall and
   tok/s, device loop vs current loop, and the prompt tokens each later turn prefilled vs the
   tokens new since the previous turn.
3. a GRPO step, 1.4B shape: materl (``ml.compile(grpo)``, fp32 weights, bf16) vs TRL 1.16
   ``GRPOTrainer`` (bf16) with ``benchmarks/vs_trl.py``'s settings (8 completions = 2 prompts x
   4, length reward, beta 0, AdamW lr 1e-6, clip 1.0) at 128 new tokens; medians after the
   first step, whose time (compiling, capturing) is reported beside; stage times of the last step.
4. tests: ``pytest -m gpu`` over the test files that hold gpu tests; each failure's assertion
   and traceback tail become rows (and the log has the whole traceback).
5. decode at batch 64 on both shapes: HF static cache + compile vs the device loop.
6. the device loop with ``capture="compile"`` (1.4B, batch 8).
7. a GRPO step, 135M shape: materl bf16 and fp32 vs TRL fp32 (the bf16-vs-fp32 question:
   stage times per row), with the engine-vs-learner log-prob mismatch.
8. the learner step with ``cuda_graphs=True`` vs eager on the same episodes (135M shape).

What the GPU machine needs beyond what it has (torch, transformers, triton, peft, accelerate,
numpy) travels as wheels, materl's own included (docs/gpu.md, "Bringing what the GPU machine
lacks"): install them into /tmp/site, then from the repository root
``PYTHONPATH=/tmp/site:$PWD python3 benchmarks/gpu_check.py``. A failing piece prints its
traceback to stderr and becomes a row; the rest runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {
    "135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True),
    "1.4b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=49152, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False),
}
PROMPTS = ["Write a short poem about the sea.", "Explain what a CPU does.", "Give me three fruit names.",
           "Describe your favourite season.", "Tell me a fun fact about cats.", "What is a good breakfast?",
           "Summarise why sleep matters.", "Name a famous scientist and say why."]
GROUP, PER_STEP, LR, SEED = 4, 8, 1e-6, 0


@dataclass
class Report:
    budget_s: float
    out: Path | None = None  # the JSON rows, rewritten after every row (a run killed midway keeps them)
    start: float = field(default_factory=time.perf_counter)
    rows: list[tuple[str, str, str]] = field(default_factory=list)

    def add(self, section: str, item: str, value: str) -> None:
        self.rows.append((section, item, value))
        print(f"[{self.elapsed():6.1f}s] {section} | {item} | {value}", flush=True)
        if self.out is not None:
            self.out.write_text(json.dumps(self.rows, indent=1))

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def guarded(self, section: str, item: str, fn, *, needs_s: float = 0.0) -> None:
        """Run ``fn()`` (which adds its own rows); a failure or a spent budget becomes a row."""
        if self.left() < needs_s:
            self.add(section, item, f"skipped: {self.left():.0f} s of the budget left, needs ~{needs_s:.0f} s")
            return
        try:
            fn()
        except ImportError as exc:
            self.add(section, item, f"skipped: {exc}")
        except Exception as exc:  # noqa: BLE001 - one failing piece must not stop the others
            traceback.print_exc()  # the whole story in the log; the row says what failed
            first = (str(exc).splitlines() or [""])[0][:200]
            self.add(section, item, f"failed: {type(exc).__name__}: {first}")

    def summary(self) -> str:
        lines = ["| section | item | result |", "|---|---|---|"]
        lines += [f"| {s} | {i} | {v.replace('|', '/')} |" for s, i, v in self.rows]
        return "\n".join(lines)


# -- models ---------------------------------------------------------------------------------------

def tokenizer_for(vocab: int):
    from materl.engines.tiny import byte_tokenizer

    return byte_tokenizer(vocab)  # bytes + chat specials + reserved ids: every sampled id decodes


def random_model(shape: str, device: torch.device, dtype: torch.dtype):
    """A Llama of ``shape`` with random weights (seeded), built directly on ``device``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from materl.engines.tiny import TINY_SPECIAL_TOKENS

    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=4096, bos_token_id=257, eos_token_id=258,
                         pad_token_id=256 + TINY_SPECIAL_TOKENS.index("<|pad|>"))
    torch.manual_seed(SEED)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(dtype).eval()


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                                            add_generation_prompt=True, tokenize=True)
        out.append([int(t) for t in (ids["input_ids"] if hasattr(ids, "keys") else ids)])
    return out


def free_memory(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# -- 1. tests -------------------------------------------------------------------------------------

def run_tests(report: Report, timeout_s: float) -> None:
    """``pytest -m gpu`` over the files holding gpu tests; each failure's assertion and the tail of
    its traceback become rows (so the log and the JSON say why, not only which)."""
    import tempfile

    # only the files with gpu tests: collecting the whole suite imports extras (ray, hypothesis, ...)
    # that the GPU machine need not have
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                   if "mark.gpu" in p.read_text())
    junit = Path(tempfile.mkdtemp(prefix="gpu_check_")) / "junit.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", *files, "-p", "no:cacheprovider", "--tb=long",
           f"--junitxml={junit}"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    tail = [line for line in out.stdout.splitlines() if line.strip()][-1:] or ["(no output)"]
    report.add("tests", "pytest -m gpu", f"rc {out.returncode}: {tail[0]}")
    for name, message, trace in junit_failures(junit) if junit.exists() else []:
        print(f"--- {name}\n{trace}", flush=True)
        report.add("tests", f"failed: {name}", f"{message[:400]} // traceback tail: "
                   + " // ".join(trace.strip().splitlines()[-TRACE_LINES:]))
    if not junit.exists():
        report.add("tests", "pytest output tail", " // ".join(out.stdout.splitlines()[-TRACE_LINES:]))


TRACE_LINES = 15


def junit_failures(path: Path) -> list[tuple[str, str, str]]:
    """(test id, assertion message, traceback) of each failed or erroring test in a junit file."""
    import xml.etree.ElementTree as ET

    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        for bad in list(case.iter("failure")) + list(case.iter("error")):
            out.append((f"{case.get('classname')}::{case.get('name')}", bad.get("message") or "", bad.text or ""))
    return out


# -- 2. decode ------------------------------------------------------------------------------------

def hf_generate(model, prompts, new_tokens: int, *, static: bool) -> float:
    device = model.device
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    kw = dict(cache_implementation="static") if static else {}
    sync(device)
    t0 = time.perf_counter()
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                   do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0, **kw)
    sync(device)
    return len(prompts) * new_tokens / (time.perf_counter() - t0)


def engine_generate(engine, prompts, new_tokens: int) -> float:
    from materl.engines.base import SamplingParams

    async def all_rows():
        params = [SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=i) for i in range(len(prompts))]
        return await asyncio.gather(*(engine.generate(p, q) for p, q in zip(prompts, params)))

    device = next(engine.model.parameters()).device
    sync(device)
    t0 = time.perf_counter()
    gens = asyncio.run(all_rows())
    sync(device)
    assert all(len(g.token_ids) == new_tokens for g in gens)
    return len(prompts) * new_tokens / (time.perf_counter() - t0)


ENGINE_RUNS = {  # engine options of each materl decode row
    "materl current loop": dict(device_loop=False),
    "materl device loop (graph)": dict(device_loop=True, capture="graph"),
    "materl device loop (compile)": dict(device_loop=True, capture="compile"),
}


def quiet_engine(model, tokenizer, batch: int, **options):
    """A transformers engine whose rows never stop on eos: every row makes exactly the tokens
    asked for, as HF's ``min_new_tokens``."""
    from materl.engines.transformers_engine import TransformersEngine

    engine = TransformersEngine(model, tokenizer, max_batch=batch, **options)
    engine.eos_ids = frozenset()
    return engine


def decode_rows(report: Report, shape: str, batch: int, new_tokens: int, device, tokenizer,
                runs: tuple[str, ...]) -> None:
    """tok/s of each of ``runs`` (HF rows and ``ENGINE_RUNS`` names) on one model; one warm-up
    call each (compiles and captures), then one timed call."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = random_model(shape, device, dtype)
    prompts = chat_prompts(tokenizer, batch)
    hf = {"HF generate eager": lambda: hf_generate(model, prompts, new_tokens, static=False),
          "HF static cache + compile": lambda: hf_generate(model, prompts, new_tokens, static=True)}
    results = {}
    for name in runs:
        def one(name=name):
            if name in hf:
                fn = hf[name]
            else:
                engine = quiet_engine(model, tokenizer, batch, **ENGINE_RUNS[name])
                fn = lambda: engine_generate(engine, prompts, new_tokens)  # noqa: E731
            fn()  # warm-up (and compile / capture)
            results[name] = fn()
            report.add("decode", f"{shape} batch {batch} x {new_tokens}: {name}", f"{results[name]:,.0f} tok/s")
        report.guarded("decode", f"{shape} batch {batch}: {name}", one,
                       needs_s=10 if device.type == "cpu" else 90 if "compile" in name else 30)
    base = results.get("HF static cache + compile")
    for name in runs:
        if base and name in ENGINE_RUNS and name in results:
            report.add("decode", f"{shape} batch {batch}: {name} / HF static+compile", f"{results[name] / base:.2f}x")
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()


# -- 3. GRPO step vs TRL ---------------------------------------------------------------------------

def length_reward(completions, **kw) -> list[float]:
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [len(t) / 100.0 for t in texts]


def materl_grpo(shape: str, device, tokenizer, new_tokens: int, steps: int, **compile_kw):
    """(median seconds per step after the first, last metrics, compiled, first step's seconds, which
    include compiling and capturing) of materl's GRPO."""
    import materl as ml
    from materl.recipes import grpo

    recipe = ml.replace(grpo, "rewards", lambda g: ml.reward(length_reward))
    recipe = ml.replace(recipe, "policy_loss", lambda g: ml.grpo_loss(g.advantages, g.policy_logprobs))
    dtype = compile_kw.pop("compute_dtype", None)
    policy = ml.Agent(random_model(shape, device, torch.float32).train(), tokenizer=tokenizer, trainable=True,
                      engine="transformers", device=device, compute_dtype=dtype, name=shape)
    compiled = ml.compile(recipe, policy=policy, ref_policy=policy, group_size=GROUP, max_new_tokens=new_tokens,
                          lr=LR, max_grad_norm=1.0, seed=SEED, temperature=1.0, **compile_kw)
    n = PER_STEP // GROUP
    times, metrics = [], {}
    for i in range(steps + 1):
        sync(device)
        t0 = time.perf_counter()
        metrics = compiled.run([PROMPTS[(i * n + k) % len(PROMPTS)] for k in range(n)])
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:] or times), metrics, compiled, times[0]


def trl_grpo(shape: str, device, tokenizer, new_tokens: int, steps: int, *, bf16: bool = False) -> float:
    import tempfile

    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            sync(device)
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            sync(device)
            times.append(time.perf_counter() - self.t0)

    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS] * 16})
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="gpu_check_trl_"), per_device_train_batch_size=PER_STEP,
        num_generations=GROUP, max_completion_length=new_tokens, learning_rate=LR, beta=0.0, loss_type="grpo",
        max_steps=steps + 1, num_train_epochs=1, gradient_accumulation_steps=1, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, temperature=1.0, save_strategy="no",
        logging_strategy="no", report_to=[], use_cpu=device.type == "cpu", bf16=bf16, fp16=False, seed=SEED,
        dataloader_num_workers=0, disable_tqdm=True, gradient_checkpointing=False)
    model = random_model(shape, device, torch.float32).train()
    GRPOTrainer(model=model, reward_funcs=length_reward, args=args, train_dataset=data, processing_class=tokenizer,
                callbacks=[Timer()]).train()
    return statistics.median(times[1:])


def grpo_rows(report: Report, shape: str, device, tokenizer, new_tokens: int, steps: int, *,
              skip_trl: bool = False, fp32: bool = True, trl_bf16: bool = False) -> None:
    """materl's GRPO step (default dtype, and fp32 if ``fp32``) vs TRL's (fp32, or bf16 with
    ``trl_bf16``): median seconds per step after the first, the first step's seconds beside."""
    results = {}
    default = "materl bf16 autocast" if device.type == "cuda" else "materl default dtype"
    variants = ((default, {}), ("materl fp32", {"compute_dtype": "float32"}))[: 2 if fp32 else 1]
    for label, kw in variants:
        def one(label=label, kw=kw):
            s, metrics, compiled, first = materl_grpo(shape, device, tokenizer, new_tokens, steps, **kw)
            compiled.close()
            results[label] = s
            mismatch = metrics.get("mismatch/mean_abs")
            stages = ", ".join(f"{k[11:]} {metrics[k]:.3f} s" for k in sorted(metrics) if k.startswith("time/stage/"))
            report.add("grpo", f"{shape}: {label}", f"{s:.3f} s/step, first step {first:.1f} s; last step: {stages}" + (
                f" (engine-vs-learner abs delta logp: mean {mismatch:.2e}, max "
                f"{metrics.get('mismatch/max_abs', float('nan')):.2e})" if mismatch is not None else ""))
        report.guarded("grpo", f"{shape}: {label}", one, needs_s=10 if device.type == "cpu" else 60)

    trl_label = f"TRL {'bf16' if trl_bf16 else 'fp32'}"

    def trl():
        import trl as trl_module

        results[trl_label] = trl_grpo(shape, device, tokenizer, new_tokens, steps, bf16=trl_bf16)
        report.add("grpo", f"{shape}: TRL {trl_module.__version__} GRPOTrainer {trl_label[4:]}",
                   f"{results[trl_label]:.3f} s/step")
    if not skip_trl:
        report.guarded("grpo", f"{shape}: TRL GRPOTrainer", trl, needs_s=10 if device.type == "cpu" else 60)
    for label, _ in variants:
        if label in results and trl_label in results:
            report.add("grpo", f"{shape}: {trl_label} / {label}", f"{results[trl_label] / results[label]:.2f}x")


# -- 4. learner: CUDA graphs vs eager --------------------------------------------------------------

def learner_rows(report: Report, shape: str, device, tokenizer, new_tokens: int, repeats: int) -> None:
    """The same episodes learned by an eager and a cuda_graphs=True step (one warm-up learn each,
    which captures); medians of the learner stage and the first update's loss on each side."""
    if device.type != "cuda":
        report.add("learner", f"{shape}: cuda_graphs=True", "skipped: needs CUDA (compile refuses it on a CPU)")
        return
    eager = materl_grpo(shape, device, tokenizer, new_tokens, 0)[2]
    episodes = eager.last_episodes
    graphed = materl_grpo(shape, device, tokenizer, new_tokens, 0, cuda_graphs=True)[2]
    out = {}
    for label, compiled in (("eager", eager), ("cuda graphs", graphed)):
        times, losses = [], []
        for _ in range(repeats + 1):
            metrics = compiled.call_blocking(compiled.learn, episodes)
            times.append(metrics["time/stage/learner"])
            losses.append(metrics["loss"])
        out[label] = (statistics.median(times[1:]), losses[0])
        report.add("learner", f"{shape}: {label}", f"{out[label][0] * 1000:.1f} ms learner stage (loss {losses[0]:.6f})")
        compiled.close()
    report.add("learner", f"{shape}: eager / cuda graphs", f"{out['eager'][0] / out['cuda graphs'][0]:.2f}x")


# -- main -----------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: a smoke run for CI")
    ap.add_argument("--device", default=None, help="default: cuda when present, else cpu")
    ap.add_argument("--budget-s", type=float, default=430.0,
                    help="no piece starts past this (a started one finishes: keep ~90 s of margin)")
    ap.add_argument("--out", default=None, help="also write the rows as JSON here")
    ap.add_argument("--skip", nargs="*", default=[],
                    choices=["tests", "decode", "agentic", "grpo", "trl", "learner", "compile", "scale"])
    args = ap.parse_args(argv)
    os.environ.setdefault("MODULAR_TELEMETRY_ENABLED", "0")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"))
    report = Report(args.budget_s, Path(args.out) if args.out else None)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "none"
    import transformers

    report.add("env", "device", f"{device} ({gpu}), torch {torch.__version__}, transformers {transformers.__version__}")
    dry = args.dry_run
    big, small = ("tiny", "tiny") if dry else ("1.4b", "135m")
    new_tokens = 4 if dry else 128
    tokenizer = tokenizer_for(SHAPES[big]["vocab_size"])
    skip = set(args.skip)
    runs = ("HF static cache + compile", "materl current loop", "materl device loop (graph)")

    def decode(shape, batch, names=runs):
        if "decode" not in skip:
            report.guarded("decode", f"{shape} batch {batch}", lambda: decode_rows(
                report, shape, batch, new_tokens, device, tokenizer, names))

    # in order of what the goals need first; the budget skips the tail
    decode(big, 2 if dry else 8, (("HF generate eager",) if dry else ()) + runs)
    if "agentic" not in skip:
        from agentic_rollout import agentic_rows

        report.guarded("agentic", big, lambda: agentic_rows(
            report, big, device, tokenizer, episodes=4 if dry else 64, turns=3, new_tokens=4 if dry else 64,
            tool_s=0.01 if dry else 0.05))
    if "grpo" not in skip:
        report.guarded("grpo", big, lambda: grpo_rows(report, big, device, tokenizer, new_tokens, steps=1 if dry else 2,
                                                      skip_trl="trl" in skip, fp32=dry, trl_bf16=not dry))
        free_memory(device)
    if "tests" not in skip and not dry:
        report.guarded("tests", "pytest -m gpu", lambda: run_tests(report, timeout_s=110.0))
    if "scale" not in skip:  # issue #39: 7B / 16k-token fits, packed vs padded, 8-bit AdamW
        __import__("gpu_learner").scale_rows(report, device, dry_run=dry)
    wide = runs if dry else ("HF static cache + compile", "materl device loop (graph)")  # each compile ~40 s
    for shape in (big,) if dry else (big, small):
        decode(shape, 4 if dry else 64, wide)
    if "compile" not in skip:
        decode(big, 2 if dry else 8, ("materl device loop (compile)",))
    if "grpo" not in skip and not dry:
        report.guarded("grpo", small, lambda: grpo_rows(report, small, device, tokenizer, new_tokens, steps=3,
                                                        skip_trl="trl" in skip))
        free_memory(device)
    if "learner" not in skip:
        report.guarded("learner", small, lambda: learner_rows(report, small, device, tokenizer, new_tokens,
                                                              repeats=1 if dry else 3), needs_s=60)
    print("\n## materl GPU check\n")
    print(report.summary())
    print(f"\n({report.elapsed():.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
