"""The training forward: logits (policy) and last hidden states (critic) at the positions that
predict each response token of a (prompt, response) batch."""

from __future__ import annotations

import torch

from posttrain.models.functional import prompt_group_size, real_token_positions
from posttrain.models.grouped_forward import grouped_forward_unsupported_reason, grouped_logits


def sequence_logits(model, prompt_ids, prompt_mask, response_ids, response_mask) -> torch.Tensor:
    """Logits predicting each response token, [B, T, V], in the model's dtype (upcast later,
    chunk by chunk). Positions count real tokens only, as the samplers do, so left padding does
    not shift a prompt's positions. Only the response positions go through the LM head.

    Where the architecture allows, this is the lean grouped forward (models/grouped_forward.py):
    rows in runs of identical prompts (an online-RL batch: a group's samples) run their prompt
    once. Otherwise the model's own forward runs every row whole."""
    if grouped_forward_unsupported_reason(model) is None:
        group_size = prompt_group_size(prompt_ids, prompt_mask)
        return grouped_logits(model, prompt_ids, prompt_mask, response_ids, response_mask, group_size)
    input_ids, attention_mask, position_ids = _inputs(prompt_ids, prompt_mask, response_ids, response_mask)
    width = response_ids.shape[1]
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   logits_to_keep=width + 1).logits
    return logits[:, :-1]


def sequence_hidden_states(model, prompt_ids, prompt_mask, response_ids, response_mask) -> torch.Tensor:
    """Last hidden states at the positions that predict each response token, [B, T, H]: the
    input of the LM head (policy) or of a value head (critic)."""
    input_ids, attention_mask, position_ids = _inputs(prompt_ids, prompt_mask, response_ids, response_mask)
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                 position_ids=position_ids).last_hidden_state
    return hidden[:, prompt_ids.shape[1] - 1 : -1]


def _inputs(prompt_ids, prompt_mask, response_ids, response_mask):
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    attention_mask = torch.cat([prompt_mask.long(), response_mask.long()], dim=1)
    position_ids = real_token_positions(attention_mask)
    return input_ids, attention_mask, position_ids
