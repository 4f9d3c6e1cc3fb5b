"""RunLogger (metrics.jsonl, progress bar, TensorBoard, W&B/MLflow hooks, samples, plot) and
format_episode."""

import json
import struct
import sys
import types

import pytest
import torch

from materl.errors import ConfigError
from materl.rollout.types import Rollout, Step, ToolCall, ToolResult
from materl.runtime.config import validate_config
from materl.runtime.logging import (
    RunLogger, draw_metrics, format_episode, numeric, plot_series, progress_fields, read_metrics,
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
            log.log(s, {"step": float(s), "reward": s / 10, "reward/answer/mean": s / 5, "reward/answer/std": 0.0,
                        "kl": 0.1 * s, "loss": 1.0 / s, "tokens": 5, "tool_success": 0.5})
        log.log(2, {"reward": 0.9})  # a repeated step (resume): the last value wins
        log.log(3, {"eval/reward": 0.7, "eval/tool_success": 1.0})
    panels = {title: {k: (steps, vals) for k, steps, vals in lines}
              for title, lines in plot_series(read_metrics(tmp_path / "metrics.jsonl"))}
    assert list(panels) == ["reward", "loss", "KL", "tool success"]  # std and tokens are not plotted
    assert list(panels["reward"]) == ["reward", "reward/answer/mean", "eval/reward"]
    assert panels["reward"]["reward"] == ([1, 2, 3], [0.1, 0.9, 0.3])
    assert panels["tool success"] == {"tool_success": ([1, 2, 3], [0.5] * 3), "eval/tool_success": ([3], [1.0])}
    png = (tmp_path / "plot.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000


def test_step_is_written_as_an_integer(tmp_path):
    with RunLogger(tmp_path, progress=False, tensorboard=False) as log:
        log.log(2, {"step": 2.0, "reward": 1.0})  # a step's metrics carry their own step
    assert lines(tmp_path / "metrics.jsonl") == [{"step": 2, "reward": 1.0}]
    assert read_metrics(tmp_path / "metrics.jsonl") == {2: {"reward": 1.0}}


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
def test_missing_backend_is_a_config_error_naming_the_extra(tmp_path, monkeypatch, backend):
    monkeypatch.setitem(sys.modules, backend, None)  # import fails as if not installed
    with pytest.raises(ConfigError, match=rf"logging.{backend}=true but {backend} is not installed; "
                                          rf"pip install 'materl\[{backend}\]'"):
        RunLogger(tmp_path, progress=False, tensorboard=False, **{backend: True})
    with pytest.raises(ConfigError, match=rf"logging.{backend}: {backend} is not installed"):
        validate_config({"logging": {backend: True}})  # refused with the config, before anything loads


def test_wandb_without_a_login_stops_before_wandb_starts(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    with pytest.raises(ConfigError, match=r"^logging.wandb=true but W&B has no login on this machine"):
        RunLogger(tmp_path / "run", progress=False, tensorboard=False, wandb=True)
    assert not (tmp_path / "run" / "wandb").exists()  # wandb.init never ran


def wandb_history(run_dir) -> list[dict]:
    """The history rows W&B wrote to an offline run's .wandb file (a LevelDB-style log of
    protobuf ``Record``s: 32 KiB blocks, 7-byte chunk headers crc/length/type)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    data, pos, records, pending = path.read_bytes(), 7, [], b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (length == 0 and kind == 0):
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            records.append(pending + chunk)
            pending = b""
        else:
            pending += chunk
    rows = []
    for raw in records:
        rec = pb.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in rec.history.item})
    return rows


def tiny_run(tmp_path, **logging_kw):
    import materl as ml
    from materl.recipes import grpo
    from materl.runtime.tasks import arithmetic_rows
    from materl.runtime.train import train

    step = ml.compile(grpo, policy=ml.Agent("tiny-random", trainable=True), ref_policy=ml.Agent("tiny-random"),
                      group_size=2, max_new_tokens=4, lr=1e-3)
    try:
        return train(step, arithmetic_rows(6, seed=0), steps=2, batch_size=2, run_dir=tmp_path, progress=False,
                     tensorboard=False, eval_dataset=arithmetic_rows(2, seed=9), eval_every=1,
                     config={"train": {"steps": 2}}, **logging_kw)
    finally:
        step.close()


def test_wandb_offline_run_receives_every_metric(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    result = tiny_run(tmp_path, wandb=True)
    rows = [r for r in wandb_history(tmp_path) if "loss" in r]
    assert [r["_step"] for r in rows] == [1, 2]
    for row, logged in zip(rows, result["history"]):
        assert row["reward"] == pytest.approx(logged["reward"]) and row["loss"] == pytest.approx(logged["loss"])
    assert [r["_step"] for r in wandb_history(tmp_path) if "eval/reward" in r] == [0, 1, 2]


def test_mlflow_store_receives_every_metric(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    result = tiny_run(tmp_path, mlflow=True)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")  # the run dir's store
    (run,) = client.search_runs(experiment_ids=["0"])
    history = client.get_metric_history(run.info.run_id, "reward")
    assert [(m.step, m.value) for m in history] == [(h["step"], pytest.approx(h["reward"])) for h in result["history"]]
    assert run.data.params["train.steps"] == "2"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval/reward")] == [0, 1, 2]


def test_a_real_run_plots_training_and_evaluation_curves(tmp_path):
    tiny_run(tmp_path)
    fig = draw_metrics(read_metrics(tmp_path / "metrics.jsonl"))
    drawn = {ax.get_ylabel(): {line.get_label(): line.get_xydata().tolist() for line in ax.get_lines()}
             for ax in fig.axes}
    assert set(drawn["reward"]) == {"reward", "reward/length/mean", "reward/diversity/mean", "eval/reward"}
    assert [x for x, _ in drawn["reward"]["reward"]] == [1, 2] and [x for x, _ in drawn["reward"]["eval/reward"]] == [0, 1, 2]
    for panel, key in (("loss", "loss"), ("KL", "policy_loss/kl"), ("entropy", "entropy"), ("tokens/s", "tokens_per_s")):
        assert [x for x, _ in drawn[panel][key]] == [1, 2], panel
    assert (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_is_written_without_evaluation(tmp_path):
    import materl as ml
    from materl.recipes import grpo
    from materl.runtime.tasks import arithmetic_rows
    from materl.runtime.train import train

    step = ml.compile(grpo, policy=ml.Agent("tiny-random", trainable=True), ref_policy=ml.Agent("tiny-random"),
                      group_size=2, max_new_tokens=4)
    few_shot = [{"role": "user", "content": "What is 1 + 1?"}, {"role": "assistant", "content": "2"}]
    rows = [{**r, "prompt": few_shot + [{"role": "user", "content": r["prompt"]}]} for r in arithmetic_rows(4, seed=0)]
    train(step, rows, steps=2, batch_size=2, run_dir=tmp_path, progress=False, tensorboard=False, samples_every=1)
    step.close()
    assert [t for t, _ in plot_series(read_metrics(tmp_path / "metrics.jsonl"))][:2] == ["reward", "loss"]
    assert (tmp_path / "plot.png").exists()
    sample = (tmp_path / "samples" / "step-000002.txt").read_text()
    assert "REWARDS: reward/diversity=" in sample and "reward/length=" in sample  # each episode's reward terms
    # each episode shows its own question, never the few-shot example's
    questions = {r["prompt"][-1]["content"] for r in rows}
    shown = [line.removeprefix("PROMPT: ") for line in sample.splitlines() if line.startswith("PROMPT: ")]
    assert len(shown) == 4 and set(shown) <= questions


def test_episode_bar_counts_episodes_and_failures(tmp_path):
    log = RunLogger(tmp_path, progress=True, total_steps=1, tensorboard=False)
    with log.episode_bar(3, "step 1") as tick:
        for error in (None, "boom", None):
            tick(types.SimpleNamespace(error=error))
    log.close()
    quiet = RunLogger(tmp_path / "q", progress=False, tensorboard=False)
    with quiet.episode_bar(3, "step 1") as tick:
        tick(types.SimpleNamespace(error=None))  # a no-op without progress
    quiet.close()


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


def test_the_question_is_the_prompts_last_user_message():
    few_shot = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1+1?"},
                {"role": "assistant", "content": "2"}, {"role": "user", "content": "What is 6*7?"}]
    turns = [{"role": "assistant", "content": "call"}, {"role": "tool", "content": "42"},
             {"role": "assistant", "content": "42"}]
    steps = [Step("generate", [1], [-0.1]), Step("tool", [2]), Step("generate", [3], [-0.1])]
    r = Rollout([0], steps, messages=few_shot + turns)
    assert r.question == "What is 6*7?"
    assert format_episode(r).splitlines()[0] == "PROMPT: What is 6*7?"
    # an environment's observation comes as a user message after the model's first turn: not the question
    env = Rollout([0], [Step("generate", [1], [-0.1]), Step("tool", [2]), Step("generate", [3], [-0.1])],
                  messages=few_shot + [{"role": "assistant", "content": "5"}, {"role": "user", "content": "higher"},
                                       {"role": "assistant", "content": "8"}])
    assert env.question == "What is 6*7?"
    assert Rollout([0], [], prompt_text="given").question == "given" and Rollout([0]).question == ""


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
