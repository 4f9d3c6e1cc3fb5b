"""An Agent is a model + tokenizer + generation engine, trainable or frozen.

    policy = ml.Agent("smollm2-135m-instruct", trainable=True)
    ref = ml.Agent("smollm2-135m-instruct")                              # frozen, own weights
    critic = ml.Agent("smollm2-135m-instruct", head="value", trainable=True)
    lora_policy = ml.Agent("tiny-random", trainable=True, lora=dict(r=8))
    remote = ml.Agent("smollm2-135m-instruct", trainable=True, engine="sglang",
                      engine_options=dict(url="http://localhost:30000"))
    mojo = ml.Agent("smollm2-135m-instruct", engine="mojo")  # also: generation_backend="mojo"

Engines (``materl.engines.ENGINES``): "transformers" (in process, torch), "mojo" (in process, a
Mojo forward pass; falls back to "transformers" with a ``MojoFallbackWarning`` where Mojo is
not installed or the model is not a Llama-family decoder) and "sglang" (a server).
``engine=None`` picks :data:`DEFAULT_ENGINE` on a CPU and "transformers" on CUDA (the Mojo forward
is CPU code; ``engine="mojo"`` with a CUDA device is an error).

Device and precision (``materl.device``): ``device=None`` puts the model on CUDA when present,
else the CPU; everything materl makes for this agent (engine inputs, learner batches) goes there.
``dtype`` is the weights' dtype (fp32 by default: the master weights the optimizer updates);
``compute_dtype`` is what forwards compute in, under ``torch.autocast`` (default bf16 on CUDA,
fp32 on a CPU, where nothing changes). A reference or value agent may sit on another device than
the policy; the learner moves each forward's inputs to that agent's device and its outputs back.

Weights load lazily, on first use of ``.model``/``.tokenizer``/``.engine`` (so building a recipe
with three agents costs nothing until it runs). Every Agent loads its own copy: two Agents of the
same name never share tensors. The learner talks to an Agent through a few methods:
``hidden_states`` (B, L, H) and ``output_embedding`` (the LM head) for fused log-prob kernels,
``values`` (B, L) for critics, ``parameters`` (those that require grad), ``state_dict`` /
``load_state_dict``, and ``copy`` for a frozen reference snapshot.
(TRL: ``model`` + ``ref_model`` + ``processing_class`` + vLLM client; verl: actor/ref/critic
worker groups + rollout worker.)
"""

from __future__ import annotations

import copy as _copy
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from materl import compute
from materl import device as _device
from materl.engines import ENGINES
from materl.engines import models as _models
from materl.errors import ConfigError

DEFAULT_ENGINE = "mojo"
"""The engine of an Agent made with ``engine=None``."""


def model_context(agent) -> int | None:
    """The agent's ``max_position_embeddings`` (None when its model does not say)."""
    model = getattr(agent, "model", None)
    config = getattr(getattr(model, "backbone", model), "config", None)
    n = getattr(config, "max_position_embeddings", None)
    return int(n) if isinstance(n, int) and n > 0 else None


class Agent:
    """A model, its tokenizer and a generation engine; see the module docstring."""

    def __init__(
        self,
        model: str | os.PathLike | nn.Module,
        trainable: bool = False,
        engine: str | None = None,
        head: str | None = None,
        lora: Mapping[str, Any] | None = None,
        dtype: torch.dtype = torch.float32,
        engine_options: Mapping[str, Any] | None = None,
        *,
        tokenizer=None,
        name: str | None = None,
        cache_dir: str | os.PathLike | None = None,
        generation_backend: str | None = None,
        device: str | torch.device | None = None,
        compute_dtype: str | torch.dtype | None = None,
    ):
        """``model``: a named model (``materl.engines.models.NAMED_MODELS``), an HF-format folder,
        or an already-built ``nn.Module`` (then pass ``tokenizer=``). ``generation_backend`` is
        another name for ``engine`` (the seed's spelling). ``device``/``compute_dtype``: see the
        module docstring. Learning rates and other learner settings are compile options
        (``ml.compile(..., lr=, value_lr=)``)."""
        if generation_backend is not None:
            if engine is not None and engine != generation_backend:
                raise ConfigError(f"engine={engine!r} and generation_backend={generation_backend!r} name two "
                                  f"engines; pass one of them")
            engine = generation_backend
        self.engine_explicit = engine is not None
        self._device = _device.resolve_device(device)
        self.compute_dtype = _device.compute_dtype(self._device, compute_dtype)
        engine = engine if engine is not None else default_engine(self._device)
        engine_cls = ENGINES.get(engine)  # unknown engine names fail here, listing the valid ones
        if not engine_cls.runs_on_cuda and self._device.type != "cpu":
            raise ConfigError(f"engine={engine!r} runs on the CPU only, but agent device is {self._device}; use "
                              f"engine='transformers' (the default on CUDA) or device='cpu'")
        if head is not None and head not in _models.HEADS:
            raise ConfigError(f"unknown head {head!r}; valid: {', '.join(_models.HEADS)} or None")
        self.lora = _models.lora_options(lora) if lora is not None else None
        self.trainable = bool(trainable)
        self.engine_name = engine
        self.head = head
        self.dtype = dtype
        self.engine_options = dict(engine_options or {})
        self.cache_dir = cache_dir
        self._model: nn.Module | None = None
        self._tokenizer = tokenizer
        self._engine = None
        self._policy_version = 0
        if isinstance(model, nn.Module):
            if tokenizer is None:
                raise ConfigError("Agent(model=<nn.Module>) needs tokenizer=; got tokenizer=None")
            if lora is not None or head is not None:
                raise ConfigError("head=/lora= apply when loading by name or path; wrap a module yourself")
            self.source = None
            self.name = name or type(model).__name__
            self._adopt(model)
        else:
            self.source = str(model)
            self.name = name or self.source

    # -- lazy parts ------------------------------------------------------------------------

    @property
    def model(self) -> nn.Module:
        if self._model is None:
            # in the compute thread, like decoding and the learner (materl/compute.py: one OpenMP pool)
            model, tokenizer = compute.call(
                _models.load_model, self.source, head=self.head, lora=self.lora, dtype=self.dtype,
                cache_dir=self.cache_dir,
            )
            self._tokenizer = tokenizer
            self._adopt(model)
        return self._model

    def autocast(self):
        """The context forwards of this agent run under: ``torch.autocast`` to ``compute_dtype``
        on its device (a no-op for fp32)."""
        return _device.autocast(self.device, self.compute_dtype)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self.model  # noqa: B018 - loads both
        return self._tokenizer

    @property
    def engine(self):
        if self._engine is None:
            cls = ENGINES.get(self.engine_name)
            try:
                self._engine = cls.for_agent(self, **self.engine_options)
            except TypeError as exc:
                raise ConfigError(f"bad engine_options {sorted(self.engine_options)} for engine "
                                  f"{self.engine_name!r}: {exc}") from exc
            self._engine.weights_version = self._policy_version
        return self._engine

    @property
    def policy_version(self) -> int:
        """How many optimizer steps the weights have had (0: as loaded); generations record it."""
        return self._policy_version

    @policy_version.setter
    def policy_version(self, version: int) -> None:
        self._policy_version = int(version)
        if self._engine is not None:
            self._engine.weights_version = self._policy_version

    @property
    def context_length(self) -> int | None:
        """The model's context in tokens (its config's ``max_position_embeddings``; None when it
        does not say). Multi-turn episodes end before a turn that would not fit."""
        config = getattr(_models.causal_lm_of(self.model), "config", None)
        n = getattr(config, "max_position_embeddings", None)
        return int(n) if isinstance(n, int) and n > 0 else None

    @property
    def loaded(self) -> bool:
        return self._model is not None

    def sleep_engine(self) -> None:
        """The rollout stage is over: let a started engine free decode-only memory (a no-op if
        the engine never started)."""
        if self._engine is not None:
            self._engine.sleep()

    def sync_engine(self) -> None:
        """The weights changed: make a started engine sample from them (in-process: drop stale
        packed copies; SGLang: push them). A no-op if the engine never started."""
        if self._engine is not None:
            self._engine.sync_weights()

    def _adopt(self, model: nn.Module) -> None:
        """Put the model on the agent's device; freeze a reference model, or make a trainable one
        train (LoRA: adapters only)."""
        if _model_device(model) != self._device:
            model.to(self._device)
        if self.trainable:
            if self.lora is None:
                model.requires_grad_(True)
            elif hasattr(model, "v_head"):
                model.v_head.requires_grad_(True)
            model.train()
        else:
            model.requires_grad_(False)
            model.eval()
        self._model = model

    # -- what the learner uses -------------------------------------------------------------

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, *,
                      position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Last hidden layer of the backbone (after the final norm), (B, L, H).

        logits = hidden @ W.T (+ b) with ``W, b = output_embedding()``; positions are
        ``cumsum(mask) - 1`` so left- and right-padded batches agree with the engine.
        Packed rows (``materl.compiler.packing``): ``attention_mask=None`` (or a prepared 4D mask)
        and ``position_ids`` restarting at 0 on each row. Works through LoRA (peft) and value-head
        wrappers.
        """
        return _models.backbone_hidden_states(self.model, input_ids, attention_mask, position_ids)

    def shared_prefix_hidden_states(self, prefix_ids, prefix_mask, owner, suffix_ids, suffix_mask):
        """Hidden states of rows that continue shared prompts, each prompt run once; see
        :func:`materl.engines.models.shared_prefix_hidden_states`."""
        return _models.shared_prefix_hidden_states(self.model, prefix_ids, prefix_mask, owner, suffix_ids, suffix_mask)

    def output_embedding(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The LM head as ``(weight (V, H), bias (V,) or None)``."""
        return _models.output_embedding(self.model)

    def values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Per-token values (B, L) from the value head (``head="value"`` agents only)."""
        if self.head != "value":
            raise ConfigError(f"agent {self.name!r} has no value head (head={self.head!r}); "
                              f"create it with Agent(..., head='value')")
        return self.model(input_ids, attention_mask)

    def values_of_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The value head applied to backbone hidden states (..., H) -> (...)."""
        if self.head != "value":
            raise ConfigError(f"agent {self.name!r} has no value head (head={self.head!r}); "
                              f"create it with Agent(..., head='value')")
        v_head = self.model.v_head
        return v_head(hidden.to(v_head.weight.dtype)).squeeze(-1)

    def parameters(self) -> list[nn.Parameter]:
        """Parameters that require grad (LoRA adapters only for LoRA agents; none when frozen)."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True):
        return self.model.load_state_dict(state_dict, strict=strict)

    @property
    def gradient_checkpointing(self) -> bool:
        """Whether the decoder layers recompute their activations in the backward."""
        return self.loaded and any(getattr(m, "gradient_checkpointing", False) for m in self.model.modules())

    def set_gradient_checkpointing(self, on: bool) -> None:
        """Recompute each decoder layer's activations in the backward (``on``) instead of keeping
        them: HF's per-layer checkpointing, non-reentrant (``torch.utils.checkpoint``), so it
        composes with LoRA, autocast and DDP/FSDP2; the learner's lean layer-by-layer forward
        (``materl.engines.decoder_forward``) steps aside for it. (TRL/verl:
        ``gradient_checkpointing=True`` / ``enable_gradient_checkpointing``.)"""
        lm = _models.causal_lm_of(self.model)
        if not getattr(lm, "supports_gradient_checkpointing", False):
            raise ConfigError(f"gradient_checkpointing=True: agent {self.name!r}'s model {type(lm).__name__} does "
                              f"not support gradient checkpointing; compile with gradient_checkpointing=False")
        kwargs = {"use_reentrant": False}
        if on and hasattr(lm, "activation_checkpointing_enable"):  # transformers >= 5.2x's name
            lm.activation_checkpointing_enable(kwargs)
        elif on:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        elif self.gradient_checkpointing:
            disable = getattr(lm, "activation_checkpointing_disable", None)
            (disable or lm.gradient_checkpointing_disable)()

    def copy(self, trainable: bool = False) -> "Agent":
        """An independent Agent with a deep copy of the current weights (a reference snapshot);
        only the tokenizer, which is never mutated, is shared."""
        clone = _copy.copy(self)
        clone.trainable = bool(trainable)
        clone.engine_options = dict(self.engine_options)
        clone._engine = None
        clone._model = None
        clone._adopt(_copy.deepcopy(self.model))
        if not clone.trainable:
            clone.set_gradient_checkpointing(False)  # a frozen snapshot never runs a backward
        return clone

    def chat_ids(self, messages: list[dict], *, tools: list | None = None,
                 add_generation_prompt: bool = True) -> list[int]:
        """Token ids of ``messages`` rendered by the chat template (tool specs Hermes style, see
        :func:`materl.engines.chat.chatml_tools_template`), as a flat list of ints."""
        out = self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True
        )
        ids = out["input_ids"] if hasattr(out, "keys") else out
        return [int(t) for t in ids]

    def to(self, device: str | torch.device) -> "Agent":
        """Move the model (and everything materl later makes for it) to ``device``."""
        self._device = _device.resolve_device(device)
        if self._model is not None:
            self._model.to(self._device)
        self._engine = None  # an engine holds device-bound state; the next use rebuilds it
        return self

    @property
    def device(self) -> torch.device:
        """Where the model's weights are (as loaded, or where ``device=``/``to`` put them)."""
        return _model_device(self._model) if self._model is not None else self._device

    def save_pretrained(self, folder: str | os.PathLike) -> None:
        """Save an HF-format folder (safetensors + config + tokenizer) that any HF loader or
        SGLang server reads: LoRA adapters merged into the weights, the value head (if any)
        as ``value_head.safetensors``."""
        from peft import PeftModel

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        model = self.model
        lm = getattr(model, "backbone", model)
        if isinstance(lm, PeftModel):
            lm = _copy.deepcopy(lm).merge_and_unload()
        lm.save_pretrained(folder)
        self.tokenizer.save_pretrained(folder)
        if hasattr(model, "v_head"):
            from materl.engines.value_head import ValueHeadModel

            ValueHeadModel.save_value_head(model.v_head, folder)

    def __repr__(self) -> str:
        parts = [repr(self.name)]
        if self._device.type != "cpu":
            parts.append(f"device={str(self._device)!r}")
        if self.trainable:
            parts.append("trainable")
        if self.head:
            parts.append(f"head={self.head!r}")
        if self.lora:
            parts.append(f"lora=r{self.lora.get('r', 16)}")
        if self.engine_explicit and self.engine_name != "transformers":
            parts.append(f"engine={self.engine_name!r}")
        return f"Agent({', '.join(parts)})"


def default_engine(device: torch.device) -> str:
    """The engine of an Agent made with ``engine=None``: :data:`DEFAULT_ENGINE` on a CPU, the
    transformers engine on CUDA (the Mojo forward is CPU code)."""
    return DEFAULT_ENGINE if device.type == "cpu" else "transformers"


def _model_device(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")
