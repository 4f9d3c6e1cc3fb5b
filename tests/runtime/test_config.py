"""TrainConfig: YAML loading, dotted overrides, validation messages that name the field."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from materl.compiler.options import CompileOptions
from materl.errors import ConfigError
from materl.runtime.config import (
    TrainConfig, apply_override, config_to_dict, load_config, recipe_choices, validate_config,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "configs"


def write(tmp_path, data) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_example_configs_load():
    tiny = load_config(EXAMPLES / "tiny_grpo.yaml")
    assert (tiny.model.name, tiny.recipe, tiny.compile.group_size) == ("tiny-random", "grpo", 2)
    assert [(r.name, r.weight) for r in tiny.rewards] == [("length", 0.1), ("diversity", 0.9)]
    calc = load_config(EXAMPLES / "calculator_grpo.yaml")
    assert calc.recipe == "grpo_tools"
    assert calc.model.name == "smollm2-135m-instruct"
    assert calc.tools == ["python -m materl.tools.calculator"]
    assert calc.data.source == "arithmetic"


def test_defaults_and_compile_options():
    cfg = validate_config({"train": {"seed": 7}, "compile": {"group_size": 3, "betas": [0.8, 0.9]}})
    assert cfg.train.steps == 100 and cfg.train.lr_schedule == "constant" and cfg.ref_model.name is None
    opts = cfg.compile_options()
    assert isinstance(opts, CompileOptions)
    # seed defaults to train.seed; YAML lists become the tuple CompileOptions wants
    assert (opts.group_size, opts.seed, opts.betas) == (3, 7, (0.8, 0.9))
    assert validate_config({"train": {"seed": 7}, "compile": {"seed": 1}}).compile_options().seed == 1
    assert (opts.infra_failures, opts.max_skipped_steps) == ("mask", 3)
    assert validate_config({"compile": {"max_skipped_steps": 0}}).compile_options().max_skipped_steps == 0


def test_the_distributed_section_sets_the_pipeline_options():
    cfg = validate_config({"distributed": {"workers": 2, "max_staleness": 2, "deterministic": True}})
    opts = cfg.compile_options()
    assert (opts.max_staleness, opts.deterministic, opts.partial_rollouts) == (2, True, False)
    assert cfg.distributed.workers == 2 and cfg.distributed.weight_transport == "object_store"
    assert validate_config({"compile": {"max_staleness": 1}}).compile_options().max_staleness == 1
    with pytest.raises(ConfigError, match="max_staleness is set in both compile .1. and distributed .2."):
        validate_config({"compile": {"max_staleness": 1}, "distributed": {"max_staleness": 2}})


def test_the_distributed_section_sets_the_learner_ranks():
    cfg = validate_config({"distributed": {"learner_ranks": 2, "learner_strategy": "fsdp2", "ray_address": "auto"}})
    assert (cfg.distributed.learner_ranks, cfg.distributed.learner_strategy) == (2, "fsdp2")
    assert (validate_config({}).distributed.learner_ranks, validate_config({}).distributed.learner_strategy) == (1, "ddp")


def test_learner_ranks_without_ray_name_the_extra(tmp_path):
    """In a process where Ray cannot be imported, learner_ranks >= 2 fails validation naming the extra."""
    code = """
import sys
class NoRay:
    def find_spec(self, name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("No module named 'ray'")
sys.meta_path.insert(0, NoRay())
from materl.errors import ConfigError
from materl.runtime.config import validate_config
print(validate_config({"distributed": {"learner_ranks": 1}}).distributed.learner_ranks)
try:
    validate_config({"distributed": {"learner_ranks": 2}})
except ConfigError as exc:
    print("ERROR:", exc)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.startswith("1\n"), out.stderr[-2000:]
    assert "ERROR:" in out.stdout and "learner_ranks=2 runs on Ray, which is not installed" in out.stdout
    assert 'pip install "materl[ray]"' in out.stdout and "learner_ranks=1" in out.stdout


def test_overrides_parse_yaml_scalars(tmp_path):
    path = write(tmp_path, {"recipe": "grpo", "rewards": [{"name": "length"}], "train": {"steps": 10}})
    cfg = load_config(path, ["train.steps=3", "compile.lr=1e-5", "logging.wandb=false",
                             "rewards.0.weight=0.5", "train.resume=null", "model.lora={r: 4}",
                             "train.run_dir=/tmp/x y"])
    assert cfg.train.steps == 3 and isinstance(cfg.train.steps, int)
    assert cfg.compile.lr == 1e-5 and cfg.compile.model_fields_set == {"lr"}  # YAML 1e-5 -> float
    assert cfg.logging.wandb is False and cfg.rewards[0].weight == 0.5 and cfg.train.resume is None
    assert cfg.model.lora == {"r": 4} and cfg.train.run_dir == "/tmp/x y"


@pytest.mark.parametrize("item, needle", [
    ("train.steps", "section.key=value"),
    ("rewards.3.weight=1", "'rewards.3' is not an index of a list of 1 items"),
    ("recipe.x=1", "'recipe' is a value, not a section"),
])
def test_bad_overrides(item, needle):
    data = {"recipe": "grpo", "rewards": [{"name": "length"}]}
    with pytest.raises(ConfigError) as e:
        apply_override(data, item)
    assert needle in str(e.value)


@pytest.mark.parametrize("override, needles", [
    ("train.steps=0", ["train.steps=0", ">= 1"]),
    ("train.batch_size=-2", ["train.batch_size=-2", ">= 1"]),
    ("train.keep_last=0", ["train.keep_last", ">= 1"]),
    ("train.lr_schedule=exp", ["train.lr_schedule='exp'", "'constant', 'linear' or 'cosine'"]),
    ("train.stpes=3", ["train.stpes", "did you mean 'steps'", "valid keys: steps, batch_size"]),
    ("train.warmup_steps=50", ["warmup_steps=50", "steps=10", "0 <= warmup_steps <= steps"]),
    ("train.steps=abc", ["train.steps", "valid integer", "'abc'"]),
    ("recipe=grpp", ["recipe", "'grpp'", "did you mean 'grpo'", "grpo_tools"]),
    ("rewards.0.name=lenght", ["rewards.0.name", "did you mean 'length'", "exact_match"]),
    ("rewards.0.wieght=1", ["rewards.0.wieght", "valid keys: name, weight, params"]),
    ("compile.group_size=0", ["compile.group_size=0", ">= 1", "episodes per prompt"]),
    ("compile.gruop_size=2", ["compile", "'gruop_size'", "did you mean 'group_size'"]),
    ("compile.kernels=cuda", ["compile.kernels='cuda'", "'auto', 'torch' or 'mojo'"]),
    ("compile.group_size=2.5", ["compile.group_size", "valid integer", "2.5", "an integer >= 1"]),
    ("compile.betas=0.9", ["compile.betas", "0.9", "a list of 2 numbers"]),
    ("compile.lr=fast", ["compile.lr", "'fast'", "valid number", "a number >= 0.0"]),
    ("compile.shuffle=maybe", ["compile.shuffle", "'maybe'", "true or false"]),
    ("compile.reference=sticky", ["compile.reference", "'sticky'", "frozen", "ema"]),
    ("compile.advantage=gpro", ["compile.advantage", "Did you mean 'grpo'"]),
    ("compile.max_skipped_steps=-1", ["compile.max_skipped_steps=-1", ">= 0", "steps in a row"]),
    ("compile.max_skipped_steps=1.5", ["compile.max_skipped_steps", "valid integer", "1.5", "an integer >= 0"]),
    ("compile.max_skipped_steps=many", ["compile.max_skipped_steps", "'many'", "an integer >= 0"]),
    ("compile.infra_failures=drop", ["compile.infra_failures='drop'", "'mask' or 'keep'"]),
    ("model.name=gpt5", ["model.name", "'gpt5'", "tiny-random"]),
    ("model.head=policy", ["model.head='policy'", "'value'"]),
    ("model.lora={rank: 4}", ["model.lora", "'rank'", "r, alpha, dropout, targets"]),
    ("tools=['ftp://host/mcp']", ["tools[0]", "http://, https://"]),
    ("data.source=missing.jsonl", ["data.source", "'missing.jsonl'", "not found", "arithmetic"]),
    ("logging.samples_every=-1", ["logging.samples_every=-1", ">= 0"]),
    ("distributed.workers=-2", ["distributed.workers=-2", ">= 0"]),
    ("distributed.weight_transport=nfs", ["distributed.weight_transport", "'nfs'", "object_store", "disk"]),
    ("distributed.ray_address=auto", ["ray_address='auto'", "workers=0"]),
    ("distributed.learner_ranks=0", ["distributed.learner_ranks=0", ">= 1"]),
    ("distributed.learner_strategy=zero3", ["distributed.learner_strategy", "'zero3'", "ddp", "fsdp2"]),
    ("distributed.correction={method: tiss}", ["distributed.correction", "tiss", "tis"]),
    ("distributed.correction={method: tis, cap2: 1}", ["distributed.correction", "cap2", "cap"]),
])
def test_bad_values_name_the_field_and_the_choices(tmp_path, override, needles):
    path = write(tmp_path, {"recipe": "grpo", "rewards": [{"name": "length"}], "train": {"steps": 10}})
    with pytest.raises(ConfigError) as e:
        load_config(path, [override])
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))


def test_several_errors_are_all_reported():
    with pytest.raises(ConfigError) as e:
        validate_config({"train": {"steps": 0, "batch_size": 0}})
    assert "2 errors" in str(e.value) and "train.steps=0" in str(e.value) and "train.batch_size=0" in str(e.value)


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("train: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "bad.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping of sections, got list"):
        load_config(tmp_path / "list.yaml")


def test_data_source_relative_to_config_file(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text('{"prompt": "hi"}\n')
    path = write(tmp_path, {"data": {"source": "data/train.jsonl"}})
    monkeypatch.chdir("/")  # not found from the working directory: found next to the config
    assert load_config(path).data.source == str(tmp_path / "data" / "train.jsonl")


def test_config_to_dict_round_trips():
    cfg = validate_config({"rewards": [{"name": "length", "weight": 0.2}], "compile": {"lr": 1e-4},
                           "model": {"lora": {"r": 8}}})
    d = config_to_dict(cfg)
    assert d["rewards"] == [{"name": "length", "weight": 0.2, "params": {}}]
    assert d["train"]["steps"] == 100 and d["logging"]["tensorboard"] is None
    assert yaml.safe_load(yaml.safe_dump(d)) == d  # plain data
    assert d["compile"]["lr"] == 1e-4 and d["compile"]["seed"] == cfg.train.seed  # the effective options
    again = validate_config(d)
    assert again.compile_options() == cfg.compile_options()
    assert again.model_dump(exclude={"compile"}) == cfg.model_dump(exclude={"compile"})


def test_recipe_choices_include_builtins_and_tool_recipes():
    import materl.recipes

    assert set(materl.recipes.names()) <= set(recipe_choices()) and "grpo_tools" in recipe_choices()
    assert isinstance(TrainConfig().recipe, str)


def test_yaml_exponent_floats(tmp_path):
    # PyYAML (YAML 1.1) reads "1e-5" as a string; configs read it as the float it means
    (tmp_path / "c.yaml").write_text("compile:\n  lr: 1e-5\n  temperature: 7E-1\ntrain:\n  run_dir: 1e5x\n")
    cfg = load_config(tmp_path / "c.yaml")
    assert (cfg.compile.lr, cfg.compile.temperature, cfg.train.run_dir) == (1e-5, 0.7, "1e5x")


def test_compile_options_are_refused_before_anything_loads(monkeypatch):
    """Validation is pure: a bad compile option fails in validate_config, which loads no model."""
    import materl.engines.models as models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    for bad in ({"group_size": 2.5}, {"betas": 0.9}, {"lr": "fast"}, {"shuffle": "maybe"}):
        with pytest.raises(ConfigError) as e:
            validate_config({"compile": bad})
        assert f"compile.{next(iter(bad))}" in str(e.value)
    with pytest.raises(ConfigError, match="compile option group_size"):
        CompileOptions.from_kwargs(group_size=2.5)


def test_duplicate_keys_name_the_file_and_both_lines(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("train:\n  steps: 3\n  batch_size: 2\n  steps: 300\nrecipe: grpo\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == (f"{path}:4: duplicate key 'steps' (first at line 2); a key may appear once per "
                            f"section (YAML would keep only the last value)")
    path.write_text("train: {steps: 3}\nlogging: {progress: false}\ntrain: {steps: 4}\n")
    with pytest.raises(ConfigError, match=rf"^{path}:3: duplicate key 'train' \(first at line 1\)"):
        load_config(path)
    path.write_text("train: {steps: 3, steps: 4}\n")  # one line, flow style
    with pytest.raises(ConfigError, match=rf"^{path}:1: duplicate key 'steps' \(first at line 1\)"):
        load_config(path)
    with pytest.raises(ConfigError, match="override 'data.params={a: 1, a: 2}': duplicate key 'a'"):
        apply_override({}, "data.params={a: 1, a: 2}")


def test_a_merge_key_may_be_overridden():
    # YAML's <<: merges a mapping; a key written after it overrides the merged one (not a duplicate)
    from materl.runtime.config_yaml import parse_yaml

    assert parse_yaml("base: &b {steps: 3, batch_size: 2}\ntrain:\n  <<: *b\n  steps: 5\n")["train"] == \
        {"steps": 5, "batch_size": 2}


def test_a_non_utf8_config_names_the_file_and_line(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"recipe: grpo\n# caf\xe9\ntrain: {steps: 1}\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == (f"config file {str(path)!r} is not UTF-8 text: byte 0xe9 on line 2 ({path}:2); "
                            f"save it as UTF-8")


def test_the_data_section_sets_prompt_length_and_truncation(tmp_path):
    cfg = validate_config({"data": {"max_prompt_tokens": 512, "truncation": "left"}})
    assert (cfg.data.max_prompt_tokens, cfg.data.truncation) == (512, "left")
    assert (TrainConfig().data.max_prompt_tokens, TrainConfig().data.truncation) == (None, "error")
    with pytest.raises(ConfigError, match=r"data.truncation='middle'; accepted: 'error', 'left' or 'right'"):
        validate_config({"data": {"truncation": "middle"}})
    with pytest.raises(ConfigError, match=r"data.max_prompt_tokens=0 is out of range; accepted: >= 1"):
        validate_config({"data": {"max_prompt_tokens": 0}})


def test_wandb_without_a_login_stops_training_before_anything_loads(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    import materl.engines.models as models
    from materl.runtime.train import train_from_config

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))  # no such file: no login
    cfg = validate_config({"logging": {"wandb": True}})  # a valid config: `materl eval` of it logs nowhere
    with pytest.raises(ConfigError) as e:
        train_from_config(cfg)
    assert str(e.value) == (f"logging.wandb=true but W&B has no login on this machine (no WANDB_API_KEY, no "
                            f"api.wandb.ai entry in {tmp_path / 'netrc'}); run `wandb login`, set WANDB_API_KEY, or "
                            f"set WANDB_MODE=offline to write the run under run_dir/wandb only (or set "
                            f"logging.wandb: false)")


def test_what_counts_as_a_wandb_login(tmp_path, monkeypatch):
    from materl.runtime.logging import wandb_login_problem

    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert "no api.wandb.ai entry" in wandb_login_problem()
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password 0123456789abcdef\n")
    (tmp_path / "netrc").chmod(0o600)  # netrc refuses a password file others can read
    assert wandb_login_problem() is None  # what `wandb login` writes
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org")
    assert "no wandb.example.org entry" in wandb_login_problem()  # a login for another host does not count
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert wandb_login_problem() is None
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_login_problem() is None
