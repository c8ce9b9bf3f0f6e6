"""Model roles besides the policy (reference, critic; later teacher, reward model), built by
one loader from one kind of config node (`roles.<name>` in conf/train.yaml):

    name_or_path: null     # another model (hub id or HF directory); null = a copy of the policy
                           # (of its base, without a LoRA adapter: see models/lora.py)
    init_from: policy      # start weights: `policy` (the policy's starting weights), a Lightning
                           # checkpoint / HF directory, or null (name_or_path's own weights)
    dtype: null            # null = the policy's
    trainable: false

A role is loaded only when a stage reads it (the module asks for it). Frozen roles are not
written into checkpoints: the module stores nothing of them and rebuilds them from this
config on resume (the policy's starting weights are rebuilt the same way). With a LoRA policy
the default reference is no copy at all: the policy's forward with its adapter switched off
(`models.lora.reference_model`).
"""

from __future__ import annotations

import torch
from torch import nn

from posttrain.errors import ConfigError
from posttrain.models.forward import sequence_hidden_states
from posttrain.models.loading import DTYPES, disable_dropout, load_initial_weights, load_pretrained
from posttrain.models.lora import copy_without_adapter


def build_role(name: str, cfg, policy: nn.Module) -> nn.Module:
    """The causal LM of role ``name`` as ``cfg`` describes it, next to ``policy`` (as loaded,
    before any training step: its weights are what `init_from: policy` means)."""
    if cfg.get("name_or_path"):
        dtype = DTYPES[cfg.dtype] if cfg.get("dtype") else next(policy.parameters()).dtype
        _, model = load_pretrained(cfg.name_or_path, f"roles.{name}.name_or_path", dtype)
    else:
        model = copy_without_adapter(policy)  # a LoRA policy's base: the adapter is the policy's alone
    init_from = cfg.get("init_from")
    if init_from == "policy" and cfg.get("name_or_path"):
        raise ConfigError(f"roles.{name}: init_from=policy copies the policy's weights into another model "
                          f"(name_or_path={cfg.name_or_path!r}); set roles.{name}.init_from=null to keep its "
                          f"own weights, or to a checkpoint or HF directory")
    if init_from not in (None, "policy"):
        load_initial_weights(model, init_from, key=f"roles.{name}.init_from")
    if cfg.get("dtype"):
        if cfg.dtype not in DTYPES:
            raise ConfigError(f"roles.{name}.dtype={cfg.dtype!r} is not one of {sorted(DTYPES)}")
        model = model.to(DTYPES[cfg.dtype])
    disable_dropout(model)
    if not cfg.get("trainable", False):
        model.requires_grad_(False).eval()
    return model


class ValueModel(nn.Module):
    """A critic: V(s_t) = w . h_t + b, h_t the last hidden state of a causal LM's decoder at the
    position that predicts response token t. The head starts at zero, so the first values are
    0 and the first GAE advantages are the plain returns."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm
        self.head = nn.Linear(lm.config.hidden_size, 1, dtype=next(lm.parameters()).dtype)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, prompt_ids, prompt_mask, response_ids, response_mask) -> torch.Tensor:
        hidden = sequence_hidden_states(self.lm, prompt_ids, prompt_mask, response_ids, response_mask)
        return self.values(hidden)

    def values(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden).squeeze(-1).float()

    def trainable_parameters(self):
        # the copied LM head is never used (its grad stays None, which AdamW skips)
        return [p for p in self.parameters() if p.requires_grad]
