"""Compile options: one typed, validated, frozen record; every knob has one default, here.

    CompileOptions.from_kwargs(group_size=8, lr=1e-5)   # what ml.compile(recipe, ..., **options) builds
    CompileOptions(group_size=2.5)                       # pydantic ValidationError
    CompileOptions.from_kwargs(group_size=2.5)           # ConfigError: "compile option group_size: ..."

The same model is the ``compile:`` section of a YAML config (``materl.runtime.config``), so a bad
type or value there is refused with its path (``compile.group_size``) before any model loads.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from materl.errors import ConfigError
from materl.ops.advantages import ADVANTAGES
from materl.ops.reference import REFERENCE_POLICIES
from materl.validation import describe


class CompileOptions(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    # rollout
    group_size: int = Field(4, ge=1, description="episodes per prompt")
    max_new_tokens: int = Field(64, ge=1, description="per model turn")
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, ge=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 = off")
    max_turns: int = Field(4, ge=1, description="cap on model turns per episode")
    max_concurrent_episodes: int = Field(256, ge=1)
    episode_timeout_s: float = Field(300.0, gt=0.0)
    tool_timeout_s: float = Field(30.0, gt=0.0, description="per tool call, for servers and toolboxes that set none")
    max_tool_output_tokens: int | None = Field(2048, ge=1, description="tool output cut to this many tokens, "
                                                                       "with a marker; null: no cap")
    context_limit: Literal["end", "fail"] = Field(
        "end", description="a multi-turn episode whose next turn would exceed the model's context (prompt so far + "
        "max_new_tokens): 'end' ends it before that turn, truncated and scored as it stands; 'fail' fails it")
    max_failed_fraction: float = Field(0.5, ge=0.0, le=1.0,
                                       description="a step in which more episodes fail stops the run")
    system_prompt: str | None = None
    infra_failures: Literal["mask", "keep"] = Field(
        "mask", description="episodes with a tool call that failed for a reason not the model's (timeout, crash, "
        "protocol, unavailable): 'mask' leaves them out of the update and their group's baseline, 'keep' trains on them")
    max_skipped_steps: int = Field(3, ge=0, description="steps in a row that may make no update because every "
                                   "episode was left out after tool infrastructure failures (an outage); one more "
                                   "stops the run")
    # asynchronous training (ml.train / materl train; run() is one lock-step step)
    max_staleness: int = Field(0, ge=0, description="rollouts may run this many policy versions ahead of "
                                                    "the learner; 0: lock-step")
    partial_rollouts: bool = Field(False, description="episodes in flight continue on new weights "
                                                      "(each token records its version)")
    deterministic: bool = Field(False, description="step k samples from exactly version max(0, k - "
                                                   "max_staleness); re-runs and resumes repeat every batch")
    # learner
    lr: float = Field(1e-6, ge=0.0)
    optimizer: Literal["adamw", "adamw_8bit", "sgd"] = Field(
        "adamw", description="adamw: fp32 state on the weights' device; adamw_8bit: torchao's 8-bit AdamW state "
        "(a quarter of the memory)")
    value_lr: float | None = Field(None, ge=0.0, description="default: lr")
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float | None = Field(1.0, gt=0.0, description="null: no clipping")
    epochs: int = Field(1, ge=1, description="passes over each rollout batch (PPO epochs)")
    mini_batch_size: int | None = Field(None, ge=1, description="rows per optimizer step; default: the batch")
    micro_batch_size: int | None = Field(None, ge=1, description="rows per forward/backward; default: the mini-batch")
    max_tokens_per_micro_batch: int | None = Field(
        None, ge=1, description="pack rows end to end (no padding computed) into micro-batches of at most this "
        "many tokens (prompt + completion; a longer row goes alone); null: padded micro-batches of "
        "micro_batch_size rows")
    gradient_checkpointing: bool = Field(False, description="recompute each decoder layer's activations in the "
                                         "backward instead of keeping them (trainable agents)")
    shuffle: bool = Field(False, description="shuffle rows between epochs (seeded)")
    logprob_chunk_size: int = Field(1024, ge=1, description="rows of the (tokens x vocab) matrix held at once")
    share_prompts: bool = Field(True, description="rows with the same prompt run it once in the learner")
    advantage: str | None = Field(None, description="default estimator; else the recipe's, else grpo")
    step_credit: Literal["process", "sum"] | None = Field(
        None, description="how step rewards are credited under a GRPO-family estimator where the recipe's "
        "ml.advantages does not say (step_credit=): 'process' (DeepSeekMath process supervision) or 'sum' "
        "(verl's summed reward); null: process")
    reference: str = Field("frozen", description="reference-model policy")
    reference_options: tuple[tuple[str, Any], ...] = ()
    seed: int = 0
    # implementation choices
    kernels: Literal["auto", "torch", "mojo"] = "auto"
    cuda_graphs: bool = False

    @model_validator(mode="after")
    def _checkpointing_graphs(self) -> CompileOptions:
        if self.gradient_checkpointing and self.cuda_graphs:
            raise ValueError("gradient_checkpointing=True with cuda_graphs=True is not supported: the captured "
                             "learner graph would have to replay the recomputation inside its backward; turn one "
                             "off (checkpointing saves memory, graphs save launch overhead on small models)")
        return self

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"each beta must be in [0, 1), got {list(v)}")
        return v

    @field_validator("reference_options", mode="before")
    @classmethod
    def _reference_options(cls, v: Any) -> Any:
        return tuple(sorted(v.items())) if isinstance(v, dict) else v

    @field_validator("advantage")
    @classmethod
    def _advantage(cls, v: str | None) -> str | None:

        if v is not None and v not in ADVANTAGES:
            raise ValueError(ADVANTAGES.unknown_message(v))
        return v

    @field_validator("reference")
    @classmethod
    def _reference(cls, v: str) -> str:

        if v not in REFERENCE_POLICIES:
            raise ValueError(REFERENCE_POLICIES.unknown_message(v))
        return v

    @classmethod
    def from_kwargs(cls, **kw: Any) -> CompileOptions:
        """Validated options from keyword arguments; ``ConfigError`` names each bad option."""
        try:
            return cls.model_validate(kw)
        except ValidationError as e:
            raise ConfigError(describe(e, cls, where="compile option(s)").replace(
                "invalid compile option(s): ", "compile option ")) from None
