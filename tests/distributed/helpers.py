"""Shared by the distributed tests: a small recipe whose rows have uneven token counts, float64
tiny agents (every process builds the same ones), the one-process reference (``ml.compile``'s
own learner on the same batches), and the rank programs the tests start (spawned processes,
torchrun, Ray actors import them from here)."""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import time
from pathlib import Path

import torch

import materl as ml

PROMPTS = ["Count to three.", "Name a colour.", "Say hi.", "Spell cat."]
BASE = dict(group_size=2, max_new_tokens=12, micro_batch_size=1, mini_batch_size=4, seed=0)
SGD = dict(optimizer="sgd", lr=0.5, max_grad_norm=None)  # the update is -lr * gradient
ADAMW = dict(lr=1e-2, max_grad_norm=0.05, epochs=2, shuffle=True)  # clipping active: norms are 0.2-0.5
# the one-process runs the tests compare with, by name: (options, LoRA or full fine-tuning); a
# "correction" option runs ml.with_off_policy_correction(pg, correction) (recomputed old log-probs)
CASES = {"full-sgd": (SGD, False), "lora-adamw": (ADAMW, True),
         "full-adamw-ema": ({**ADAMW, "reference": "ema", "reference_options": {"decay": 0.5}}, False),
         "tis-adamw": ({**ADAMW, "correction": "tis"}, False),
         # packed micro-batches of <= 40 tokens (several rows each), tokens balanced across ranks,
         # LoRA with gradient checkpointing
         "packed-lora-ckpt": ({**ADAMW, "micro_batch_size": None, "max_tokens_per_micro_batch": 40,
                               "gradient_checkpointing": True}, True)}


@ml.recipe
def pg(policy, ref_policy, prompts):
    # stop="0" ends tiny-random's completions after 1..12 tokens: rows with uneven token counts,
    # so a rank's share of the tokens is not its share of the rows (the global-denominator point)
    completions = ml.generate(policy, prompts, stop=["0"], name="completions")
    policy_logprobs = ml.logprobs(policy, prompts, completions, name="policy_logprobs")
    ref_logprobs = ml.logprobs(ref_policy, prompts, completions, name="ref_logprobs")
    advantages = ml.advantages(ml.reward("length"), name="advantages")
    ml.set_loss(ml.policy_loss(advantages, policy_logprobs, ref_logprobs, agg="token_mean", kl="k3", kl_coef=0.1))


def tiny_agents(lora: bool = False) -> dict:
    """A float64 tiny-random policy (LoRA r=4 with seeded, non-zero adapters) and reference;
    the same in every process."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        policy = ml.Agent("tiny-random", trainable=True, dtype=torch.float64, lora=dict(r=4) if lora else None)
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:  # peft starts B at zero, which would leave A without gradient at step 1
                p.data.copy_(torch.randn_like(p) * 0.05)
    return {"policy": policy, "ref_policy": ml.Agent("tiny-random", dtype=torch.float64)}


def lora_agents() -> dict:
    return tiny_agents(lora=True)


@contextlib.contextmanager
def one_thread():
    """torch on one thread here, as in each rank: on 2 cores shared with the ranks and other
    work, a 2-thread OpenMP pool spin-waits against them (the tiny reference runs 10x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@functools.cache
def case(name: str) -> dict:
    """``reference`` for ``CASES[name]``, computed once per test session (the tests share it)."""
    options, lora = CASES[name]
    return reference(options, lora=lora)


def reference(options: dict, *, lora: bool = False, steps: int = 2) -> dict:
    """``steps`` one-process steps (``ml.compile``'s learner), recording each step's batch as
    the ranks will receive it (pickled before learning), the trainable weights before and
    after, and the metrics. One episode of the first batch is filtered out: 7 rows.

    Under torch.distributed the learner runs the decoder layers' own forwards (FSDP2 gathers a
    layer's weights in its forward hooks), so the reference does too: the lean forward of one
    process (``materl.engines.decoder_forward``) rounds gradients differently, and is checked
    against these forwards in ``tests/engines/test_decoder_forward.py``."""
    from materl.engines import decoder_forward

    supports, decoder_forward.supports = decoder_forward.supports, lambda lm: False
    try:
        with one_thread():
            return _reference(options, lora, steps)
    finally:
        decoder_forward.supports = supports


def _reference(options: dict, lora: bool, steps: int) -> dict:
    agents = tiny_agents(lora)
    options = dict(options)
    correction = options.pop("correction", None)
    recipe = ml.with_off_policy_correction(pg, correction) if correction else pg
    step = ml.compile(recipe, **agents, **{**BASE, **options})
    before = trainable(agents["policy"])
    out = {"batches": [], "weights": [before], "metrics": []}
    for k in range(steps):
        episodes = step.call_blocking(step.rollout, PROMPTS)
        if k == 0:
            episodes[3].filtered = True
        out["batches"].append(pickle.dumps((episodes, step.context())))
        out["metrics"].append(step.call_blocking(step.learn, episodes))
        out["weights"].append(trainable(agents["policy"]))
    step.close()
    return out


def trainable(agent) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in agent.model.named_parameters() if p.requires_grad}


# ----------------------------------------------------------------------------- rank programs


def run_configs(rank: int, world_size: int, port: int, configs: list[dict], out: str) -> None:
    """A spawned rank: join a gloo group, then for each config build the agents, wrap them and
    learn on the config's batches; write rank 0's results and every rank's own weights."""
    from materl.distributed.torchrun import init_process_group, leave_process_group

    torch.set_num_threads(1)
    init_process_group(rank, world_size, master_addr="127.0.0.1", master_port=port)
    try:
        for cfg in configs:
            learn_config(rank, cfg, out)
    finally:
        leave_process_group()


def learn_config(rank: int, cfg: dict, out: str) -> None:
    """Learn the config's batches; then, in a fresh learner, resume from the state saved after
    the first step (every rank loads rank 0's) and learn the second batch again."""
    from materl.distributed.learner import DistributedLearner
    from materl.distributed.state import trainable_weights

    batches = [pickle.loads(b) for b in cfg["batches"]]
    options = batches[0][1].options
    learner = DistributedLearner(tiny_agents(cfg["lora"]), options, strategy=cfg["strategy"])
    results, saved = [], [None]
    for k, (episodes, ctx) in enumerate(batches):
        results.append(learner.step(episodes, ctx))
        if k == 0:
            saved = [learner.state()]  # collective; rank 0 holds it
    own = trainable_weights(learner.agents["policy"].model, keep=True)  # FSDP2: gathered
    del learner
    torch.distributed.broadcast_object_list(saved, src=0)
    fresh = DistributedLearner(tiny_agents(cfg["lora"]), options, strategy=cfg["strategy"])
    fresh.load_state(saved[0])
    resumed = fresh.step(*batches[1])
    torch.save({"results": [(r.version, r.metrics, r.weights) for r in results], "own": own,
                "state": saved[0], "resumed": resumed.weights}, Path(out) / f"{cfg['name']}-rank{rank}.pt")


def hold_agents(hold: str, marker: str, lora: bool = False, rank: int = 1) -> dict:
    """Tiny agents; on rank ``rank``, once the path ``hold`` exists, the policy's next forward
    writes this process's pid to ``marker`` and waits there (for the test to kill it mid-step)."""
    import torch.distributed as dist

    from materl.engines.hf import causal_lm_of

    agents = tiny_agents(lora)
    if dist.get_rank() == rank:
        hold_path, marker_path = Path(hold), Path(marker)

        def wait_if_told(module, args):
            if hold_path.exists():
                marker_path.write_text(str(os.getpid()))
                time.sleep(600)

        causal_lm_of(agents["policy"].model).get_decoder().register_forward_pre_hook(wait_if_told)
    return agents


def slow_rank_agents() -> dict:
    """``hold_agents`` from $MATERL_TEST_HOLD and $MATERL_TEST_MARKER (for ``--agents`` of the
    torchrun entry point, which takes a function of no arguments)."""
    return hold_agents(os.environ["MATERL_TEST_HOLD"], os.environ["MATERL_TEST_MARKER"])


def wait_for_pid(marker: Path, timeout_s: float = 300.0) -> int:
    """The pid a held rank wrote to ``marker``."""
    deadline = time.monotonic() + timeout_s
    while not (marker.exists() and marker.read_text().strip()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no rank wrote {marker} within {timeout_s:.0f} s")
        time.sleep(0.05)
    return int(marker.read_text())


def gone(pid: int) -> bool:
    """The process has exited (a zombie counts: it runs nothing and holds no socket)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return "\nState:\tZ" in status
