"""materl: an asyncio dataflow engine for agentic, tool-use RL of LLMs.

    import materl as ml

    @ml.recipe
    def grpo(policy, ref_policy, prompts): ...

    step = ml.compile(grpo, policy=ml.Agent("smollm2-135m-instruct", trainable=True), ...)
    metrics = step.run(prompts=batch)

Public names load on first use, so ``python -m materl.tools.calculator`` (a tool server) does
not pay for importing torch.
"""

import logging
from importlib import import_module

# torchao (materl[memory], for optimizer="adamw_8bit") is imported by transformers and peft
# whenever it is installed; on a CPU build it logs missing CUDA kernels and torch pytree
# deprecations at import. They say nothing about the user's run, so they stay below ERROR.
for _noisy in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_noisy).setLevel(logging.ERROR)

from materl.errors import *  # noqa: F403
from materl.registry import Registry

__version__ = "0.1.0"

_EXPORTS = {
    "materl.graph.node": ["Node", "Recipe"],
    "materl.graph.trace": ["Value"],
    "materl.graph.recipe": ["algorithm", "recipe", "replace", "transform", "with_kl", "with_off_policy_correction"],
    "materl.graph.custom": ["mojo_op", "op"],
    "materl.graph.constructors": [
        "add_loss", "advantages", "call_tools", "cispo_loss", "clip_cov_loss", "dpo_loss", "env_rollout", "filter_groups",
        "gae_advantages", "generate", "generate_step", "gpg_loss", "grpo_loss", "gspo_loss", "kl_cov_loss",
        "gigpo_advantages", "logprobs", "policy_loss", "ppo_loss", "reinforce_loss", "reward", "sapo_loss", "set_loss",
        "structure_rollout", "turn_advantages", "value_loss", "values",
    ],
    "materl.graph.agents": ["agent_episodes", "judge"],
    "materl.graph.self_play": ["self_play"],
    "materl.graph.distill": ["distill_advantages", "with_distillation"],
    "materl.compiler.compiled": ["Compiled", "compile"],
    "materl.agent": ["Agent"],
    "materl.rollout.mcp": ["MCPServer", "PythonTools", "Toolbox", "mcp_tools"],
    "materl.rollout.env": ["Environment"],
    "materl.rollout.self_play": ["TextArenaGame", "TwoPlayerGame", "game_outcome"],
    "materl.runtime.train": ["train", "train_rlhf"],
    "materl.runtime.train_settings": ["TrainSettings"],
    "materl.runtime.evaluate": ["evaluate"],
    "materl.runtime.export": ["export"],
    "materl.runtime.curriculum": ["Curriculum", "Knobbed"],
    "materl.runtime.early_stop": ["EarlyStopping"],
    "materl.runtime.reasoning_tasks": ["ReasoningGymTask"],
    "materl.runtime.verifiers_env": ["VerifiersEnv"],
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
_SUBMODULES = {"kernels", "ops", "recipes", "benchmark", "tools"}

__all__ = sorted(_WHERE) + ["Registry", "__version__"]


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return import_module(f"materl.{name}")
    raise AttributeError(f"module 'materl' has no attribute {name!r}")


def __dir__():
    return __all__
