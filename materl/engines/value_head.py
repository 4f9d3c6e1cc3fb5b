"""A scalar value head over a causal LM's last hidden layer (the critic of PPO/VAPO).

    values_B_L = ValueHeadModel.wrap(causal_lm)(input_ids, attention_mask)   # one value per token

The head is ``Linear(H, 1)`` applied to the backbone's final (normed) hidden states, as TRL's
``AutoModelForCausalLMWithValueHead`` (``v_head.summary``) and verl's critic
(``AutoModelForTokenClassification(num_labels=1)``, i.e. ``score: Linear(H, 1)``) do. Its weight
starts at N(0, initializer_range) from a fixed seed and its bias at 0 (verl's token
classification init), so two fresh value models are identical and a run is reproducible.
The head saves next to the backbone as ``value_head.safetensors``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from materl.engines.hf import backbone_hidden_states, causal_lm_of

VALUE_HEAD_FILE = "value_head.safetensors"
_INIT_SEED = 0


class ValueHeadModel(nn.Module):
    """``backbone`` (an HF causal LM, possibly peft-wrapped) + ``v_head`` (Linear(H, 1))."""

    def __init__(self, backbone: nn.Module, v_head: nn.Linear):
        super().__init__()
        self.backbone = backbone
        self.v_head = v_head

    @classmethod
    def wrap(cls, backbone: nn.Module, *, folder: str | Path | None = None) -> "ValueHeadModel":
        """Add a value head to ``backbone``: loaded from ``folder/value_head.safetensors`` when
        present, else freshly initialised (seeded, see module docstring)."""
        lm = causal_lm_of(backbone)
        hidden = lm.config.hidden_size
        ref = lm.get_output_embeddings().weight
        v_head = nn.Linear(hidden, 1, device=ref.device, dtype=ref.dtype)
        path = Path(folder) / VALUE_HEAD_FILE if folder is not None else None
        if path is not None and path.exists():
            from safetensors.torch import load_file

            v_head.load_state_dict(load_file(str(path), device=str(ref.device)))
        else:
            std = float(getattr(lm.config, "initializer_range", 0.02))
            gen = torch.Generator().manual_seed(_INIT_SEED)
            with torch.no_grad():
                v_head.weight.copy_(torch.randn(v_head.weight.shape, generator=gen) * std)
                v_head.bias.zero_()
        return cls(backbone, v_head)

    @property
    def config(self):
        return causal_lm_of(self.backbone).config

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Backbone last hidden layer, (B, L, H)."""
        return backbone_hidden_states(self.backbone, input_ids, attention_mask)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Per-token values ``v_head(h_t)``, (B, L): the value of the state after token t.

        For response token t the learner reads the value at position (prompt_len + t - 1), as
        TRL and verl do (``values[:, -response_length - 1:-1]``).
        """
        hidden = self.hidden_states(input_ids, attention_mask)
        return self.v_head(hidden.to(self.v_head.weight.dtype)).squeeze(-1)

    def save_pretrained(self, folder: str | Path, **kwargs) -> None:
        """Backbone via ``save_pretrained`` plus ``value_head.safetensors``."""
        self.backbone.save_pretrained(folder, **kwargs)
        self.save_value_head(self.v_head, folder)

    @staticmethod
    def save_value_head(v_head: nn.Linear, folder: str | Path) -> None:
        from safetensors.torch import save_file

        state = {k: v.detach().contiguous().cpu() for k, v in v_head.state_dict().items()}
        save_file(state, str(Path(folder) / VALUE_HEAD_FILE))
