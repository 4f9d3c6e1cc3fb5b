"""RunLogger (metrics.jsonl, progress bar, TensorBoard, W&B/MLflow hooks, samples, plot) and
format_episode."""

import json
import sys
import types

import pytest
import torch

from materl.errors import ConfigError
from materl.rollout.types import Rollout, Step, ToolCall, ToolResult
from materl.runtime.logging import (
    RunLogger, format_episode, numeric, plot_series, progress_fields, read_metrics,
)


def lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_metrics_jsonl_keeps_numbers_only(tmp_path):
    log = RunLogger(tmp_path, progress=False, tensorboard=False)
    rec = log.log(3, {"reward": 0.5, "loss": torch.tensor(2.0), "ok": True, "n": 4, "name": "grpo",
                      "vec": torch.ones(3), "bad": float("nan"), "none": None})
    log.log(4, {"reward": 1})
    log.close()
    # strings, None and multi-value tensors are skipped; bool/int/tensor -> float; NaN -> null
    assert rec == {"reward": 0.5, "loss": 2.0, "ok": 1.0, "n": 4.0, "bad": None}
    assert lines(tmp_path / "metrics.jsonl") == [
        {"step": 3, "reward": 0.5, "loss": 2.0, "ok": 1.0, "n": 4.0, "bad": None},
        {"step": 4, "reward": 1.0},
    ]


def test_progress_fields():
    # tokens/s = tokens / time/step = 120 / 0.5 = 240; kl falls back to policy_loss/kl
    m = {"reward": 0.25, "loss": -0.125, "policy_loss/kl": 0.01, "tokens": 120.0, "time/step": 0.5, "lr": 1e-5}
    assert progress_fields(m) == {"reward": "0.25", "loss": "-0.125", "kl": "0.01", "tok/s": "240.0"}
    assert progress_fields({"tokens": 10.0, "time/step": 0.0}) == {}  # no division by zero


def test_progress_bar_follows_steps(tmp_path):
    log = RunLogger(tmp_path, progress=True, total_steps=5, tensorboard=False)
    log.log(2, {"reward": 0.5, "tokens": 10, "time/step": 2.0})
    assert log._bar.n == 2 and log._bar.postfix == "reward=0.5, tok/s=5.0"
    log.log(2, {"eval/reward": 0.1})  # an eval record at the same step does not advance the bar
    assert log._bar.n == 2
    log.close()


def test_samples_are_appended_per_step(tmp_path):
    with RunLogger(tmp_path, progress=False, tensorboard=False) as log:
        path = log.log_samples(3, ["first\n", "second"])
        log.log_samples(3, ["third"])
    assert path == tmp_path / "samples" / "step-000003.txt"
    text = path.read_text()
    assert text.index("episode 1 =====\nfirst\n") < text.index("episode 2 =====\nsecond") < text.index("third")


def test_plot_series_and_png(tmp_path):
    with RunLogger(tmp_path, progress=False, tensorboard=False) as log:
        for s in (1, 2, 3):
            log.log(s, {"reward": s / 10, "reward/answer/mean": s / 5, "reward/answer/std": 0.0, "kl": 0.1 * s,
                        "loss": 1.0 / s, "tokens": 5})
        log.log(2, {"reward": 0.9})  # a repeated step (resume): the last value wins
    series = {k: (steps, vals) for k, steps, vals in plot_series(read_metrics(tmp_path / "metrics.jsonl"))}
    assert list(series) == ["reward", "reward/answer/mean", "kl", "loss"]  # std and tokens are not plotted
    assert series["reward"] == ([1, 2, 3], [0.1, 0.9, 0.3])
    png = (tmp_path / "plot.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000


def test_nothing_to_plot(tmp_path):
    log = RunLogger(tmp_path, progress=False, tensorboard=False)
    log.log(1, {"lr": 1e-5})
    assert log.close() is None and not (tmp_path / "plot.png").exists()
    assert log.close() is None  # closing twice is harmless


def test_torn_last_line_is_ignored(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward": 1.0}\n{"step": 2, "rew')
    assert read_metrics(tmp_path / "metrics.jsonl") == {1: {"reward": 1.0}}


def test_tensorboard_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with RunLogger(tmp_path, progress=False, tensorboard=True) as log:
        log.log(1, {"reward": 0.5, "skip": "x"})
        log.log(2, {"reward": 0.75})
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward")] == [(1, 0.5), (2, 0.75)]
    assert acc.Tags()["scalars"] == ["reward"]


@pytest.mark.parametrize("backend", ["wandb", "mlflow"])
def test_missing_backend_is_a_config_error(tmp_path, monkeypatch, backend):
    monkeypatch.setitem(sys.modules, backend, None)  # import fails as if not installed
    with pytest.raises(ConfigError, match=f"logging.{backend}=true but {backend} is not installed"):
        RunLogger(tmp_path, progress=False, tensorboard=False, **{backend: True})


def test_wandb_and_mlflow_receive_metrics(tmp_path, monkeypatch):
    calls = []
    run = types.SimpleNamespace(log=lambda m, step: calls.append(("wandb.log", step, m)),
                                finish=lambda: calls.append(("wandb.finish",)))
    wandb = types.SimpleNamespace(init=lambda **kw: calls.append(("wandb.init", kw["config"])) or run)
    mlflow = types.SimpleNamespace(
        start_run=lambda run_name=None: calls.append(("mlflow.start",)),
        log_params=lambda p: calls.append(("mlflow.params", p)),
        log_metrics=lambda m, step: calls.append(("mlflow.log", step, m)),
        end_run=lambda: calls.append(("mlflow.end",)))
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setitem(sys.modules, "mlflow", mlflow)
    with RunLogger(tmp_path, progress=False, tensorboard=False, wandb=True, mlflow=True,
                   config={"train": {"steps": 2}}) as log:
        log.log(1, {"reward": 0.5, "bad": float("inf"), "s": "x"})
    assert calls == [
        ("wandb.init", {"train": {"steps": 2}}), ("mlflow.start",), ("mlflow.params", {"train.steps": "2"}),
        ("wandb.log", 1, {"reward": 0.5}), ("mlflow.log", 1, {"reward": 0.5}),
        ("wandb.finish",), ("mlflow.end",),
    ]


def test_numeric_handles_numpy():
    np = pytest.importorskip("numpy")
    assert numeric({"a": np.float32(0.5), "b": np.int64(3), "c": np.array([1.0, 2.0])}) == {"a": 0.5, "b": 3.0}


def tool_rollout() -> Rollout:
    return Rollout(prompt_ids=[1, 2, 3], prompt_text="What is 6*7?", steps=[
        Step("generate", [10, 11], [-0.1, -0.2], text='<tool_call>{"name": "calculate"}</tool_call>',
             tool_calls=[ToolCall("calculate", {"expression": "6*7"}),
                         ToolCall("calc", {}, raw="<tool_call>{bad", error="invalid JSON")],
             finish_reason="tool_call", reward=0.2),
        Step("tool", [12, 13, 14], tool_results=[ToolResult("calculate", "42", latency_s=0.25),
                                                 ToolResult("calc", "unknown tool 'calc'", is_error=True)]),
        Step("generate", [15], [-0.3], text="The answer is 42.", finish_reason="stop", reward=1.0),
    ])


def test_format_episode_shows_turns_calls_results_and_rewards():
    text = format_episode(tool_rollout(), metrics={"reward/answer": 1.0, "note": "x"})
    assert text.splitlines() == [
        "PROMPT: What is 6*7?",
        "--- turn 1 · 2 tokens, finish=tool_call, reward=0.2 ---",
        '<tool_call>{"name": "calculate"}</tool_call>',
        '  > tool call calculate({"expression": "6*7"})',
        "  ! malformed tool call: invalid JSON | raw: <tool_call>{bad",
        "--- tool · 3 tokens ---",
        "  < calculate [ok, 0.25s]: 42",
        "  < calc [ERROR, 0.00s]: unknown tool 'calc'",
        "--- turn 2 · 1 tokens, finish=stop, reward=1 ---",
        "The answer is 42.",
        "STEP REWARDS: 0.2, 1 (sum 1.2)",
        "REWARDS: reward/answer=1",
    ]


def test_format_episode_decodes_tokens_and_shows_errors():
    class Tok:
        def decode(self, ids, skip_special_tokens=False):
            return "".join(chr(ord("a") + i) for i in ids)

    r = Rollout(prompt_ids=[0, 1], steps=[Step("generate", [2, 3], [-1.0, -1.0])], error="timeout after 5s")
    assert format_episode(r, Tok()).splitlines() == [
        "PROMPT: ab", "--- turn 1 · 2 tokens ---", "cd", "EPISODE ERROR: timeout after 5s"]
    assert format_episode(r).splitlines()[:3] == ["PROMPT: (2 prompt tokens)", "--- turn 1 · 2 tokens ---",
                                                  "(2 tokens)"]
    assert format_episode(None) == "(no rollout)"
