"""The ``materl`` command, run in-process through ``main([...])`` (and once as a subprocess)."""

import subprocess
import sys
import types

import pytest

import materl.recipes
from materl.cli import describe_tool, main, recipe_summary


def test_recipes_lists_builtins_with_first_doc_line(capsys):
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out] == materl.recipes.names()
    grpo = next(line for line in out if line.startswith("grpo "))
    assert grpo.split(None, 1)[1] == recipe_summary("grpo")
    assert "Group Relative Policy Optimization" in grpo


def test_recipes_name_prints_the_graph(capsys):
    assert main(["recipes", "grpo"]) == 0
    assert capsys.readouterr().out.strip() == str(materl.recipes.get("grpo")).strip()


def test_materl_errors_print_their_message_and_exit_2(capsys):
    assert main(["recipes", "grpp"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("materl recipes: error: unknown recipe 'grpp'")
    assert "Traceback" not in captured.err and "did you mean 'grpo'" in err[0].lower()


def test_train_config_errors_list_every_field(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("train: {steps: 0, batch_size: 0}\n")
    assert main(["train", str(cfg)]) == 2
    err = capsys.readouterr().err.rstrip().splitlines()
    # a summary line, then each validation error indented below it
    assert err[0].startswith("materl train: error: invalid config") and "2 errors" in err[0]
    assert len(err) == 3 and err[1].startswith("  train.steps=0") and err[2].startswith("  train.batch_size=0")
    assert main(["eval", str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read config file" in capsys.readouterr().err


def test_eval_checkpoint_without_a_config_uses_the_saved_one(tmp_path, capsys):
    from materl.agent import Agent
    from materl.runtime.checkpoint import save_checkpoint
    from materl.runtime.config import config_to_dict, validate_config
    from materl.runtime.evaluate import checkpoint_config

    saved = validate_config({"train": {"steps": 7}, "data": {"test_size": 3}})
    agents = {"policy": Agent("tiny-random", trainable=True)}
    save_checkpoint(tmp_path / "run", 1, agents=agents, optimizers={}, config=config_to_dict(saved))
    cfg = checkpoint_config(str(tmp_path / "run"), ["data.test_size=2"])
    assert (cfg.train.steps, cfg.data.test_size) == (7, 2)  # the saved config, with the override
    save_checkpoint(tmp_path / "bare", 1, agents=agents, optimizers={})  # ml.train without config=
    assert main(["eval", "--checkpoint", str(tmp_path / "bare")]) == 2
    err = capsys.readouterr().err
    assert "has no config.yaml (saved by ml.train without config=); give the config file: materl eval " \
           f"CONFIG.yaml --checkpoint {tmp_path / 'bare'}" in err


def test_train_and_eval_call_the_runtime(tmp_path, capsys, monkeypatch):
    """train/eval load the config (with --set overrides) and hand it to the runtime."""
    seen = {}
    train = types.ModuleType("materl.runtime.train")
    train.train_from_config = lambda cfg: seen.setdefault("train", cfg) and {"reward": 0.5}
    evaluate = types.ModuleType("materl.runtime.evaluate")
    evaluate.evaluate_from_config = lambda cfg, ckpt: seen.setdefault("eval", (cfg, ckpt)) and {"accuracy": 1.0}
    monkeypatch.setitem(sys.modules, "materl.runtime.train", train)
    monkeypatch.setitem(sys.modules, "materl.runtime.evaluate", evaluate)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("recipe: grpo\ntrain: {steps: 10}\n")
    assert main(["train", str(cfg), "--set", "train.steps=3", "--set", "compile.lr=1e-5"]) == 0
    assert (seen["train"].train.steps, seen["train"].compile.lr) == (3, 1e-5)
    assert '"reward": 0.5' in capsys.readouterr().out
    assert main(["eval", str(cfg), "--checkpoint", "runs/x"]) == 0
    assert seen["eval"][0].train.steps == 10 and seen["eval"][1] == "runs/x"
    assert '"accuracy": 1.0' in capsys.readouterr().out


def test_tools_passes_the_command_line(monkeypatch, capsys):
    import materl.rollout.mcp as mcp

    got = []
    spec = {"type": "function", "function": {"name": "calculate", "description": "Evaluate it.\nMore.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"},
                                                            "digits": {"type": "integer"}},
                           "required": ["expression"]}}}
    monkeypatch.setattr(mcp, "list_tools", lambda server, timeout_s: got.append(server) or [spec])
    assert main(["tools", "python", "-m", "materl.tools.calculator"]) == 0
    assert got == [["python", "-m", "materl.tools.calculator"]]  # "-m" is not taken as a materl option
    assert capsys.readouterr().out == "calculate(expression: string, [digits: integer])  Evaluate it.\n"
    assert main(["tools", "http://localhost:8000/mcp"]) == 0
    assert got[-1] == "http://localhost:8000/mcp"
    assert main(["tools"]) == 2
    assert "give an MCP server command line" in capsys.readouterr().err


def test_tools_lists_the_calculator_server(capsys):
    assert main(["tools", "python", "-m", "materl.tools.calculator"]) == 0
    assert capsys.readouterr().out.startswith("calculate(expression: string)")


def test_describe_tool_without_parameters():
    assert describe_tool({"function": {"name": "ping"}}) == "ping()"


def test_bench_kernels(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "materl.benchmark", None)
    assert main(["bench", "kernels"]) == 2
    assert "materl.benchmark is not available" in capsys.readouterr().err
    fake = types.ModuleType("materl.benchmark")
    fake.main_kernels = lambda: print("kernels ok")
    monkeypatch.setitem(sys.modules, "materl.benchmark", fake)
    assert main(["bench", "kernels"]) == 0
    assert capsys.readouterr().out == "kernels ok\n"


def test_usage_errors_exit_2():
    with pytest.raises(SystemExit) as e:
        main(["bench", "gpus"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2


def test_python_dash_m_subprocess():
    proc = subprocess.run([sys.executable, "-m", "materl.cli", "recipes"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert [line.split()[0] for line in proc.stdout.splitlines()] == materl.recipes.names()


def test_memory_flags_are_compile_overrides(tmp_path):
    """``--gradient-checkpointing``, ``--max-tokens-per-micro-batch N`` and ``--optimizer NAME``
    are ``--set compile.<option>=...``, validated with the config (docs/scaling-up.md)."""
    from materl.cli import build_parser
    from materl.runtime.config import load_config

    args = build_parser().parse_args(["train", "examples/configs/tiny_grpo.yaml", "--gradient-checkpointing",
                                      "--max-tokens-per-micro-batch", "4096", "--optimizer", "adamw_8bit"])
    assert args.overrides == ["compile.gradient_checkpointing=true", "compile.max_tokens_per_micro_batch=4096",
                              "compile.optimizer=adamw_8bit"]
    options = load_config(args.config, overrides=args.overrides).compile_options()
    assert (options.gradient_checkpointing, options.max_tokens_per_micro_batch, options.optimizer) == (
        True, 4096, "adamw_8bit")
