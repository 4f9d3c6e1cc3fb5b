"""The ``materl`` command.

    materl train CONFIG.yaml [--set train.steps=3 ...]     train from a config (see runtime/config.py)
    materl eval [CONFIG.yaml] [--checkpoint PATH]          evaluate the config's model or a checkpoint
    materl export CHECKPOINT OUT_DIR [--agent policy] [--no-merge]
    materl recipes [NAME] [--tool SERVER]                  list built-in recipes / print one's graph
    materl tools COMMAND...                                list an MCP server's tools
    materl compare RUN_DIR RUN_DIR ... [--metrics reward,loss] [--out compare.png]
    materl sweep CONFIG.yaml [--set sweep.parallel=2 ...]  Optuna sweep of train runs (runtime/sweep.py)
    materl bench kernels                                   kernel benchmarks

Errors materl raises on purpose (``MaterlError``) print their message to stderr (the first line
after ``error:``, details indented below it) and exit with status 2; anything else is a bug and
keeps its traceback. SIGINT (Ctrl-C) and SIGTERM stop a command cleanly and exit 130 / 143; a
second one exits at once (``materl.runtime.signals``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from materl.errors import ConfigError, Interrupted, MaterlError
from materl.runtime import signals


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    with signals.handled():  # SIGINT/SIGTERM: a clean stop; a second one exits at once
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    try:
        return int(args.func(args) or 0)
    except MaterlError as e:
        first, *details = _lines(e)
        print(f"materl {args.command}: error: {first}", file=sys.stderr)
        for line in details:  # e.g. each failing config field, each kind of failed episode
            print(f"  {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Interrupted (SIGINT, SIGTERM) or a plain Ctrl-C
        code = e.exit_code if isinstance(e, Interrupted) else 130
        reaped = signals.kill_descendants()  # what a clean stop left behind (none, normally)
        left = f"; stopped {len(reaped)} leftover child process(es)" if reaped else ""
        print(f"materl {args.command}: interrupted ({e or 'SIGINT received'}), exit {code}{left}", file=sys.stderr)
        return code


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="materl", description="materl: tool-use RL for LLMs as compiled dataflow recipes")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_train_parser, _eval_parser, _export_parser, _recipes_parser, _tools_parser, _compare_parser,
                _sweep_parser, _bench_parser):
        add(sub)
    return p


def _train_parser(sub) -> None:
    t = sub.add_parser("train", help="train from a YAML config")
    t.add_argument("config", help="path to a YAML config (see examples/configs/)")
    t.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set train.steps=3 (repeatable)")
    _placement_flags(t)
    _early_stopping_flags(t)
    t.add_argument("--step-credit", dest="overrides", action=_AsOverride, key="compile.step_credit",
                   choices=["process", "sum"],
                   help="how step rewards are credited under grpo/dr_grpo where the recipe does not say "
                        "(= --set compile.step_credit=...; default: process)")
    _memory_flags(t)
    t.set_defaults(func=cmd_train)


def _eval_parser(sub) -> None:
    e = sub.add_parser("eval", help="evaluate a config's model, or a checkpoint of it")
    e.add_argument("config", nargs="?", default=None,
                   help="path to a YAML config; default with --checkpoint: the config saved in the checkpoint")
    e.add_argument("--checkpoint", default=None, help="checkpoint folder or run dir (its latest)")
    e.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    _placement_flags(e)
    e.set_defaults(func=cmd_eval)


def _export_parser(sub) -> None:
    x = sub.add_parser("export", help="write a checkpoint's agent as a plain Hugging Face model folder")
    x.add_argument("checkpoint", help="checkpoint folder or run dir (its latest)")
    x.add_argument("out_dir")
    x.add_argument("--agent", default="policy", help="which agent of the checkpoint (default: policy)")
    x.add_argument("--no-merge", dest="merge_lora", action="store_false",
                   help="keep LoRA adapters separate (writes a peft adapter folder)")
    x.set_defaults(func=cmd_export)


def _recipes_parser(sub) -> None:
    r = sub.add_parser("recipes", help="list built-in recipes, or print one's graph")
    r.add_argument("name", nargs="?", help="a built-in recipe or package.module:recipe")
    r.add_argument("--tool", dest="tools", action="append", default=[], metavar="SERVER",
                   help="tool server for recipes built from a Toolbox (default for grpo_tools: the calculator)")
    r.set_defaults(func=cmd_recipes)


def _tools_parser(sub) -> None:
    tl = sub.add_parser("tools", help="list the tools of an MCP server command line or URL")
    tl.add_argument("server", nargs=argparse.REMAINDER, metavar="COMMAND...",
                    help="e.g. python -m materl.tools.calculator, or http://host:port/mcp")
    tl.add_argument("--timeout", type=float, default=30.0, help=argparse.SUPPRESS)
    tl.set_defaults(func=cmd_tools)


def _compare_parser(sub) -> None:
    c = sub.add_parser("compare", help="final and best metrics of runs side by side, and one plot of them")
    c.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="folders runs wrote (each with metrics.jsonl)")
    c.add_argument("--metrics", default=None, metavar="NAMES",
                   help="comma-separated metric names or shell patterns (reward/*/mean) for the table and the "
                        "plot, or 'all' (default: a short set in the table: reward and its terms, "
                        "masked_episodes, loss, kl, tool_calls, tool_success, first/last-turn advantages, "
                        "eval; reward, reward terms, loss, eval/accuracy, eval/reward, tool_success in the plot)")
    c.add_argument("--out", default="compare.png", help="where the plot is written (default: compare.png)")
    c.add_argument("--columns", default="final,best", metavar="COLUMNS",
                   help="comma-separated columns per run: final, best, first, mean (default: final,best)")
    c.set_defaults(func=cmd_compare)


def _sweep_parser(sub) -> None:
    sw = sub.add_parser("sweep", help="a hyperparameter sweep of train runs (grid, random or Optuna TPE, pruned)")
    sw.add_argument("config", help="a train config with a 'sweep' section (see examples/configs/tiny_sweep.yaml)")
    sw.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config value, e.g. --set sweep.parallel=2 or --set train.steps=4")
    sw.set_defaults(func=cmd_sweep)


def _bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="run benchmarks")
    b.add_argument("what", choices=["kernels"])
    b.set_defaults(func=cmd_bench)


# ----------------------------------------------------------------------------- commands


def _placement_flags(p: argparse.ArgumentParser) -> None:
    """``--device``/``--dtype``: the same as ``--set model.device=...``/``--set model.dtype=...``."""
    p.add_argument("--device", dest="overrides", action=_AsOverride, key="model.device",
                   help="cpu, cuda or cuda:N for every agent (default: cuda when present)")
    p.add_argument("--dtype", dest="overrides", action=_AsOverride, key="model.dtype",
                   choices=["float32", "bfloat16", "float16"],
                   help="compute dtype (weights and optimizer state stay float32; default: bf16 on CUDA)")


def _early_stopping_flags(p: argparse.ArgumentParser) -> None:
    """``--early-stopping METRIC``, ``--patience N``, ``--min-delta X``, ``--stop-at X``: the same as ``--set
    train.early_stopping.metric=...`` (any of them turns early stopping on)."""
    p.add_argument("--early-stopping", dest="overrides", action=_AsOverride, key="train.early_stopping.metric",
                   metavar="METRIC", help="stop when this eval metric (e.g. eval/accuracy) stops improving")
    p.add_argument("--patience", dest="overrides", action=_AsOverride, key="train.early_stopping.patience",
                   metavar="N", help="evaluations without improvement before stopping (default 3)")
    p.add_argument("--min-delta", dest="overrides", action=_AsOverride, key="train.early_stopping.min_delta",
                   metavar="X", help="the least change that counts as an improvement (default 0)")
    p.add_argument("--stop-at", dest="overrides", action=_AsOverride, key="train.early_stopping.stop_at",
                   metavar="X", help="also stop once the metric reaches X (>= in mode max, <= in mode min)")
def _memory_flags(p: argparse.ArgumentParser) -> None:
    """The learner's memory options (docs/scaling-up.md), as ``--set compile.<option>=...``."""
    p.add_argument("--gradient-checkpointing", dest="overrides", action=_AsOverride, nargs=0, const="true",
                   key="compile.gradient_checkpointing", help="recompute decoder layers in the backward")
    p.add_argument("--max-tokens-per-micro-batch", dest="overrides", action=_AsOverride, metavar="N",
                   key="compile.max_tokens_per_micro_batch", help="pack rows into micro-batches of N tokens")
    p.add_argument("--optimizer", dest="overrides", action=_AsOverride, key="compile.optimizer",
                   choices=["adamw", "adamw_8bit", "sgd"], help="optimizer and where its state lives")


class _AsOverride(argparse.Action):
    """A flag that appends ``key=value`` to the ``--set`` overrides (validated with them)."""

    def __init__(self, *args, key: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.key = key

    def __call__(self, parser, namespace, value, option_string=None):
        value = self.const if self.nargs == 0 else value  # a switch (--gradient-checkpointing)
        items = [*(getattr(namespace, self.dest, None) or []), f"{self.key}={value}"]  # never the shared default
        setattr(namespace, self.dest, items)


def cmd_train(args: argparse.Namespace) -> int:
    from materl.runtime.config import load_config

    cfg = load_config(args.config, args.overrides)
    from materl.runtime.train import train_from_config

    result = train_from_config(cfg)
    # every step's metrics are in run_dir/metrics.jsonl; the summary is the rest
    _print_metrics({k: v for k, v in result.items() if k != "history"})
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from materl.runtime.config import load_config

    if args.config is not None:
        cfg = load_config(args.config, args.overrides)
    elif args.checkpoint is not None:
        from materl.runtime.evaluate import checkpoint_config

        cfg = checkpoint_config(args.checkpoint, args.overrides)
    else:
        raise ConfigError("eval: give a config (materl eval CONFIG.yaml) or a checkpoint, whose saved config is "
                          "used (materl eval --checkpoint RUN_DIR)")
    from materl.runtime.evaluate import evaluate_from_config

    _print_metrics(evaluate_from_config(cfg, args.checkpoint))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from materl.runtime.export import export

    out = export(args.checkpoint, args.out_dir, agent=args.agent, merge_lora=args.merge_lora)
    print(f"exported agent {args.agent!r} to {out}")
    return 0


def cmd_recipes(args: argparse.Namespace) -> int:
    import materl.recipes

    if args.name:
        from materl.runtime.resolve import resolve_recipe

        print(resolve_recipe(args.name, tools=args.tools, search=[Path.cwd()]))
        return 0
    names = materl.recipes.names()
    width = max(map(len, names), default=0)
    for name in names:
        print(f"{name:<{width}}  {recipe_summary(name)}")
    return 0


def cmd_tools(args: argparse.Namespace) -> int:
    server = list(args.server)
    if server and server[0] == "--":
        server = server[1:]
    if not server:
        raise ConfigError("tools: give an MCP server command line or URL, e.g. materl tools python -m "
                          "materl.tools.calculator")
    from materl.rollout.mcp import list_tools

    spec: Any = server[0] if len(server) == 1 and "://" in server[0] else server
    for tool in list_tools(spec, timeout_s=args.timeout):
        print(describe_tool(tool))
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from materl.runtime.compare import compare

    metrics = [m.strip() for m in args.metrics.split(",") if m.strip()] if args.metrics is not None else None
    columns = [c.strip() for c in args.columns.split(",") if c.strip()]
    table, plot = compare(args.run_dirs, metrics=metrics, out=args.out, columns=columns)
    print(table)
    print(f"plot: {plot}" if plot is not None else "plot: none (no metric to draw; choose some with --metrics)")
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from materl.runtime.sweep import run_sweep

    sweep_sets = [o for o in args.overrides if o.startswith("sweep.")]
    result = run_sweep(args.config, [o for o in args.overrides if not o.startswith("sweep.")],
                       sweep_overrides=sweep_sets, say=lambda line: print(line, flush=True))
    print(result["table"])
    if result["best"] is not None:
        print(f"best: trial {result['best']['number']} ({result['best']['value']:.4g}) in {result['best']['run_dir']}")
    if result["compare"] is not None:
        print(result["compare"])
        print(f"plot: {result['plot']}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    try:
        bench = importlib.import_module("materl.benchmark")
    except ImportError as e:
        if e.name not in ("materl.benchmark", "materl"):
            raise
        raise ConfigError("bench kernels: materl.benchmark is not available in this install") from None
    fn = getattr(bench, f"main_{args.what}", None)
    if fn is None:
        raise ConfigError(f"bench {args.what}: materl.benchmark has no main_{args.what}()")
    return int(fn() or 0)


# ----------------------------------------------------------------------------- printing


def recipe_summary(name: str) -> str:
    """First line of a built-in recipe's docstring (the recipe's, else its module's)."""
    import materl.recipes

    doc = materl.recipes.doc(name) or (sys.modules.get(f"materl.recipes.{name}").__doc__
                                       if f"materl.recipes.{name}" in sys.modules else "") or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def describe_tool(tool: dict[str, Any]) -> str:
    """``name(arg: type, [opt: type])  description`` for an OpenAI-format function spec."""
    fn = tool.get("function", tool)
    params = fn.get("parameters") or {}
    required = set(params.get("required") or [])
    args = []
    for arg, schema in (params.get("properties") or {}).items():
        kind = schema.get("type", "any") if isinstance(schema, dict) else "any"
        args.append(f"{arg}: {kind}" if arg in required else f"[{arg}: {kind}]")
    desc = (fn.get("description") or "").strip()
    first = desc.splitlines()[0] if desc else ""
    return f"{fn.get('name', '?')}({', '.join(args)})" + (f"  {first}" if first else "")


def _print_metrics(result: Any) -> None:
    if isinstance(result, dict):
        print(json.dumps(result, indent=2, default=str, sort_keys=True))
    elif result is not None:
        print(result)


def _lines(e: BaseException) -> list[str]:
    text = str(e).strip() or type(e).__name__
    return [line.strip() for line in text.splitlines() if line.strip()]


if __name__ == "__main__":
    sys.exit(main())
