"""Models and batches the training-forward tests score: SmolLM2-135M's layout at toy width, and
left-padded prompts with responses of uneven lengths."""

from __future__ import annotations

import torch
import transformers


def smollm2_shaped() -> transformers.LlamaForCausalLM:
    """SmolLM2-135M's layout at toy width: 9 query heads over 3 kv heads, tied embeddings, no biases."""
    config = transformers.LlamaConfig(vocab_size=48, hidden_size=72, num_hidden_layers=2, num_attention_heads=9,
                                      num_key_value_heads=3, intermediate_size=96, max_position_embeddings=256,
                                      tie_word_embeddings=True, rope_parameters={"rope_type": "default",
                                                                                 "rope_theta": 100000.0})
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config).train()


def uneven_batch(vocab: int, group_size: int, seed: int = 0, width: int = 40):
    """3 left-padded prompts (6 tokens, padded 0 / 2 / 1) x `group_size` responses of lengths 1 to
    `width` (a prefix mask, the shortest and the longest always present)."""
    g = torch.Generator().manual_seed(seed)
    plen = 6
    prompts = torch.randint(3, vocab, (3, plen), generator=g)
    prompt_mask = torch.ones_like(prompts)
    for row, pad in enumerate((0, 2, 1)):
        prompts[row, :pad], prompt_mask[row, :pad] = 0, 0
    rows = 3 * group_size
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    lengths[0], lengths[-1] = 1, width
    response_mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
    response_ids = torch.randint(3, vocab, (rows, width), generator=g) * response_mask.long()
    return (prompts.repeat_interleave(group_size, 0), prompt_mask.repeat_interleave(group_size, 0),
            response_ids, response_mask)
