"""Bad inputs through the real ``materl`` command: bad dataset files and rows, over-long prompts,
bad config files, ``eval --checkpoint`` without a config, W&B without a login. Each run must
end with exit 2 and one message naming the file and line (or row), before any step runs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MATERL = Path(sys.executable).with_name("materl")  # the console script installed with the package


def materl(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    environ = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([str(MATERL), *args], cwd=cwd, capture_output=True, text=True, timeout=300, env=environ)


def config(folder: Path, name: str = "cfg.yaml", **sections) -> Path:
    """examples/configs/tiny_grpo.yaml with ``sections`` merged in (one level deep)."""
    cfg = yaml.safe_load((ROOT / "examples/configs/tiny_grpo.yaml").read_text())
    cfg["train"].update(steps=1, run_dir=str(folder / "run"))
    for key, value in sections.items():
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) and isinstance(cfg.get(key), dict) else value
    path = folder / name
    path.write_text(yaml.safe_dump(cfg))
    return path


def jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def error_lines(out: subprocess.CompletedProcess, command: str = "train") -> list[str]:
    """The message the command printed: its ``error:`` line and the indented lines below it."""
    assert out.returncode == 2, (out.returncode, out.stderr[-3000:])
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = out.stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"materl {command}: error: "))
    return [lines[start].removeprefix(f"materl {command}: error: ")] + \
        [line.strip() for line in lines[start + 1:] if line.startswith("  ")]


GOOD = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(6)]


def test_a_bad_json_line_names_file_and_line(tmp_path):
    data = jsonl(tmp_path / "train.jsonl", [*GOOD[:2], '{"prompt": "What is 2 + 2?", "answer": 4', *GOOD[2:]])
    out = materl("train", str(config(tmp_path, data={"source": str(data)})), cwd=tmp_path)
    (first,) = error_lines(out)
    assert first.startswith(f"{data}:3: not valid JSON: Expecting ',' delimiter"), first
    assert not (tmp_path / "run").exists()  # nothing ran


def test_non_utf8_data_names_file_and_line(tmp_path):
    data = jsonl(tmp_path / "train.jsonl", GOOD)
    data.write_bytes(data.read_bytes() + b'{"prompt": "Caf\xe9?", "answer": "1"}\n')  # a Latin-1 row: line 7
    out = materl("train", str(config(tmp_path, data={"source": str(data)})), cwd=tmp_path)
    # '{"prompt": "Caf' is 15 bytes, so 0xe9 is column 16
    assert error_lines(out) == [f"{data}:7: not UTF-8 text (byte 0xe9 at column 16); save the file as UTF-8"]


def test_bad_rows_and_missing_reward_columns_are_listed_with_file_and_line(tmp_path):
    rows = [*GOOD, {"prompt": "   ", "answer": "1"},
            {"messages": [{"role": "robot", "content": "hi"}], "answer": "1"},
            {"messages": "What is 1 + 1?", "answer": "2"}, {"prompt": "What is 5 + 5?"}]
    data = jsonl(tmp_path / "train.jsonl", rows)
    out = materl("train", str(config(tmp_path, data={"source": str(data), "test_size": 2},
                                     rewards=[{"name": "exact_match"}])), cwd=tmp_path)
    lines = error_lines(out)
    assert lines[0] == "3 bad dataset rows:" and lines[1:] == [
        f"{data}:7: 'prompt' is only whitespace ('   ')",
        f"{data}:8: messages[0].role='robot'; accepted: system, user, assistant, tool",
        f"{data}:9: 'messages' must be a non-empty list of {{'role', 'content'}} messages, got str 'What is 1 + 1?'"]
    # with the rows fixed, the row without the column exact_match reads is the one reported
    data = jsonl(tmp_path / "train.jsonl", [*GOOD, {"prompt": "What is 5 + 5?"}])
    out = materl("train", str(config(tmp_path, data={"source": str(data), "test_size": 2},
                                     rewards=[{"name": "exact_match"}])), cwd=tmp_path)
    assert error_lines(out) == [f"{data}:7: column 'answer', which reward 'exact_match' reads, is missing; the row "
                                f"has: prompt"]
    assert not (tmp_path / "run").exists()


def test_an_over_long_prompt_fails_naming_the_row_or_is_cut_when_asked(tmp_path):
    data = jsonl(tmp_path / "train.jsonl", [*GOOD, {"prompt": "many words " * 9_091, "answer": "1"}])  # 100,001 chars
    cfg = config(tmp_path, data={"source": str(data), "test_size": 2})
    out = materl("train", str(cfg), cwd=tmp_path)
    (first,) = error_lines(out)
    assert first.startswith(f"{data}:7: the prompt is ") and first.endswith(
        "tokens (with the chat template, as node 'completions' renders it), over the limit of 4088: the context "
        "of agent 'policy' (4096 positions, max_position_embeddings) less max_new_tokens=8; shorten it, or set "
        "truncation (data.truncation: left|right) to cut it"), first
    assert not (tmp_path / "run").exists()
    out = materl("train", str(cfg), "--set", "data.truncation=left", "--set", "data.max_prompt_tokens=256",
                 cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout)["checkpoint"].endswith("step-000001")


def test_duplicate_config_keys_name_file_and_line(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text((ROOT / "examples/configs/tiny_grpo.yaml").read_text() + "recipe: dapo\n")
    line = len(path.read_text().splitlines())
    first = next(i for i, text in enumerate(path.read_text().splitlines(), 1) if text.startswith("recipe:"))
    assert error_lines(materl("train", str(path), cwd=tmp_path)) == [
        f"{path}:{line}: duplicate key 'recipe' (first at line {first}); a key may appear once per section "
        f"(YAML would keep only the last value)"]


def test_a_non_utf8_config_is_a_clear_error(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"# r\xe9glages\n" + (ROOT / "examples/configs/tiny_grpo.yaml").read_bytes())
    assert error_lines(materl("eval", str(path), cwd=tmp_path), "eval") == [
        f"config file {str(path)!r} is not UTF-8 text: byte 0xe9 on line 1 ({path}:1); save it as UTF-8"]


def test_eval_of_a_checkpoint_reads_its_saved_config(tmp_path):
    out = materl("train", str(config(tmp_path)), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    out = materl("eval", "--checkpoint", str(tmp_path / "run"), "--set", "data.test_size=2", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = json.loads(out.stdout)
    assert metrics["episodes"] == 2.0 and metrics["failed"] == 0.0  # the saved config, test_size overridden
    assert error_lines(materl("eval", cwd=tmp_path), "eval") == [
        "eval: give a config (materl eval CONFIG.yaml) or a checkpoint, whose saved config is used "
        "(materl eval --checkpoint RUN_DIR)"]


def test_wandb_without_a_login_is_a_config_error(tmp_path):
    pytest.importorskip("wandb")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(NETRC=str(tmp_path / "netrc"), OMP_NUM_THREADS="1")  # no such file: no `wandb login`
    cfg = config(tmp_path, logging={"wandb": True})
    out = subprocess.run([str(MATERL), "train", str(cfg)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300, env=env)
    assert error_lines(out) == [
        f"logging.wandb=true but W&B has no login on this machine (no WANDB_API_KEY, no api.wandb.ai entry in "
        f"{tmp_path / 'netrc'}); run `wandb login`, set WANDB_API_KEY, or set WANDB_MODE=offline to write the run "
        f"under run_dir/wandb only (or set logging.wandb: false)"]
