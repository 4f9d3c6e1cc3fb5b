"""The config's teacher section (on-policy distillation from a config): a named model, an HF
folder or a checkpoint, its device/engine options, the recipe it goes with, and errors that name
the key, the value, the choices and the file:line."""

import pytest
import torch
import yaml

from materl.agent import Agent
from materl.engines.tiny import build_tiny_random
from materl.errors import ConfigError
from materl.runtime.build import build_from_config
from materl.runtime.checkpoint import save_checkpoint
from materl.runtime.config import load_config

BASE = {"model": {"name": "tiny-random"}, "data": {"source": "arithmetic", "train_size": 4, "test_size": 2},
        "compile": {"group_size": 2, "max_new_tokens": 4}, "train": {"steps": 1, "batch_size": 2}}


def write(tmp_path, text: str):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(BASE) + text)
    return path


def line_of(path, needle: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if needle in line)


@pytest.fixture(scope="module")
def teacher_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("teacher") / "tiny-teacher"
    build_tiny_random(folder, seed=1)
    return folder


def test_a_distill_recipe_gets_the_teacher_with_its_options(tmp_path, teacher_folder):
    path = write(tmp_path, f"recipe: distill\nteacher:\n  name: {teacher_folder}\n  device: cpu\n"
                           f"  engine: transformers\n  dtype: float32\n")
    cfg = load_config(path)
    assert (cfg.teacher.name, cfg.teacher.device, cfg.teacher.engine) == (str(teacher_folder), "cpu", "transformers")
    compiled, _, _ = build_from_config(cfg, load_data=False)
    teacher = compiled.agents["teacher"]
    assert (teacher.source, teacher.trainable, teacher.engine_name, str(teacher.device)) == (
        str(teacher_folder), False, "transformers", "cpu")
    assert compiled.recipe.node("advantages").params == {"coef": 1.0, "discount": 0.0}
    metrics = compiled.run(prompts=["hi", "yo"])
    compiled.close()
    assert metrics["advantages/reverse_kl"] != 0  # a teacher with other weights: a non-zero KL


def test_any_other_recipe_is_distilled_with_the_weight_and_discount(tmp_path, teacher_folder):
    path = write(tmp_path, f"recipe: grpo\nrewards: [{{name: length}}]\nteacher: {{name: {teacher_folder}, "
                           f"weight: 0.25, discount: 0.5}}\n")
    compiled, _, _ = build_from_config(load_config(path), load_data=False)
    assert compiled.recipe.node("advantages").params == {"coef": 0.25, "discount": 0.5}
    assert compiled.recipe.node("advantages_prev").op == "advantages" and "teacher" in compiled.recipe.params
    compiled.close()


@pytest.mark.parametrize("lora", [None, {"r": 4}], ids=["full", "lora"])
def test_a_checkpoint_teacher_is_rebuilt_with_its_trained_weights(tmp_path, lora):
    trained = Agent("tiny-random", trainable=True, lora=lora)
    learned = [p for p in trained.model.parameters() if p.requires_grad]
    with torch.no_grad():
        for p in learned:
            p.add_(0.01)
    save_checkpoint(tmp_path / "teacher_run", 3, agents={"policy": trained},
                    optimizers={"policy": torch.optim.SGD(learned, lr=0.1)})
    path = write(tmp_path, f"recipe: distill\nteacher: {{name: {tmp_path / 'teacher_run'}}}\n")
    compiled, _, _ = build_from_config(load_config(path), load_data=False)
    teacher = compiled.agents["teacher"]
    assert not teacher.trainable and not any(p.requires_grad for p in teacher.model.parameters())
    for (name, got), want in zip(teacher.model.state_dict().items(), trained.model.state_dict().values()):
        assert torch.equal(got, want), name
    compiled.close()
    path = write(tmp_path, f"recipe: distill\nteacher: {{name: {tmp_path / 'teacher_run'}, agent: critic}}\n")
    with pytest.raises(ConfigError, match="has no agent 'critic'; agents: policy"):
        build_from_config(load_config(path), load_data=False)


@pytest.mark.parametrize("text, key, needles", [
    ("recipe: distill\nteacher:\n  name: no-such-model\n", "name: no-such-model",
     ["teacher.name", "'no-such-model'", "neither a named model", "checkpoint", "tiny-random"]),
    ("recipe: distill\nteacher:\n  name: tiny-random\n  engine: vllm\n", "engine: vllm",
     ["teacher.engine", "unknown engine 'vllm'", "transformers", "mojo"]),
    ("recipe: distill\nteacher:\n  name: tiny-random\n  device: gpu0\n", "device: gpu0",
     ["teacher.device", "'gpu0' is not a torch device", "cpu, cuda, cuda:N"]),
    ("recipe: grpo\nteacher:\n  name: tiny-random\n  weight: -1\n", "weight: -1",
     ["teacher.weight=-1", ">= 0"]),
    ("recipe: distill\nteacher:\n  name: tiny-random\n  agent: critic\n", "teacher:",
     ["teacher.agent='critic'", "not a checkpoint"]),
    ("recipe: distill\nteacher:\n  name: tiny-random\n  temperature: 2\n", "temperature: 2",
     ["teacher.temperature", "unknown key", "engine_options"]),
    ("recipe: distill\n", "recipe: distill",
     ["recipe 'distill' distils from a teacher", "no teacher section", "teacher: {name:"]),
    ("recipe: distill\nteacher:\n  name: tiny-random\n  weight: 0.5\n", "weight: 0.5",
     ["teacher.weight=0.5", "with_distillation", "recipe 'distill' has its own teacher term"]),
])
def test_bad_teacher_values_name_the_key_the_choices_and_the_line(tmp_path, text, key, needles):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    for needle in [*needles, f"{path}:{line_of(path, key)}"]:
        assert needle in str(e.value), (needle, str(e.value))


def test_any_bad_value_of_a_file_names_its_line_but_an_override_does_not(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("recipe: grpo\ntrain:\n  batch_size: 2\n  steps: 0\n")
    with pytest.raises(ConfigError, match=rf"train.steps=0 is out of range; accepted: >= 1.* \({path}:4\)$"):
        load_config(path)
    with pytest.raises(ConfigError) as e:
        load_config(path, ["train.steps=5", "teacher.name=no-such-model"])
    assert "teacher.name" in str(e.value) and f"{path}:" not in str(e.value)
