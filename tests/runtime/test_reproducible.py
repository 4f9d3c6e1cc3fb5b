"""The same seed, weights, prompts and dependencies give the same run, idle or under load.

Run twice in this process: once alone, once beside two processes that burn both CPU cores. The
engine closes decode batches when the event loop has nothing ready (not after a time window),
so the batches, and therefore every token, log-prob, reward, update and metric, are the same.
The reward uses numpy's global RNG, which ``ml.train`` seeds.
"""

import subprocess
import sys

import numpy as np
import torch

import materl as ml
from materl.recipes import grpo
from materl.runtime.tasks import arithmetic_rows
from materl.runtime.train import train

BURN = "import time\nend = time.time() + 300\nwhile time.time() < end:\n    pass\n"


def noisy_length(*, completions, **_):
    """A reward with numpy noise: reproducible only if numpy's global RNG is seeded."""
    return [len(c) / 10 + float(np.random.rand()) for c in completions]


def run(tmp_path, name):
    step = ml.compile(ml.replace(grpo, "rewards", lambda g: ml.reward(noisy_length)),
                      policy=ml.Agent("tiny-random", trainable=True), ref_policy=ml.Agent("tiny-random"),
                      group_size=4, max_new_tokens=12, lr=1e-3, temperature=1.0)
    try:
        result = train(step, arithmetic_rows(12, seed=3), steps=3, batch_size=4, seed=11, run_dir=tmp_path / name,
                       progress=False, tensorboard=False)
    finally:
        step.close()
    history = [{k: v for k, v in h.items() if not k.startswith("time") and k != "tokens_per_s"}
               for h in result["history"]]
    return history, [p.detach().clone() for p in step.agents["policy"].parameters()]


def test_same_run_idle_and_beside_a_cpu_burning_process(tmp_path):
    idle_history, idle_weights = run(tmp_path, "idle")
    burners = [subprocess.Popen([sys.executable, "-c", BURN]) for _ in range(2)]
    try:
        busy_history, busy_weights = run(tmp_path, "busy")
    finally:
        for b in burners:
            b.kill()
            b.wait()
    assert idle_history == busy_history  # every metric, exactly: rewards, loss, kl, grad_norm, tokens ...
    assert len(idle_history) == 3 and idle_history[0]["reward"] != idle_history[1]["reward"]
    assert all(torch.equal(a, b) for a, b in zip(idle_weights, busy_weights))
