"""The embedded default: a character-level tokenizer and a tiny random-init causal LM.

Both are ordinary Hugging Face objects built locally (no hub access): `save_pretrained`
output reloads with `AutoTokenizer` / `AutoModelForCausalLM` and generates.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"


def build_char_tokenizer(alphabet: str | Sequence[str], model_max_length: int | None = None) -> PreTrainedTokenizerFast:
    """One token per symbol of ``alphabet`` plus pad / eos / unk specials. A symbol is a
    character, or a whole word where ``alphabet`` is a sequence holding longer strings (the
    r1 template's tags, "<think>" ...: one token each, as in Qwen3's vocabulary).

    ``model_max_length`` is the model's context (its max_position_embeddings): prompt checks
    read it, and the export records it instead of transformers' "unknown" sentinel (1e30).
    """
    symbols = list(dict.fromkeys(alphabet))  # de-duplicated, order kept
    chars = [s for s in symbols if len(s) == 1]
    words = [s for s in symbols if len(s) > 1]
    vocab = {tok: i for i, tok in enumerate([PAD, EOS, UNK] + chars)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()  # join characters back without spaces
    extra = {} if model_max_length is None else {"model_max_length": model_max_length}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, eos_token=EOS, unk_token=UNK, padding_side="left", **extra
    )
    # added tokens, matched before the split into characters: an exported tokenizer keeps them
    # whatever class transformers reloads it as (a Qwen2 model's gets Qwen2's own pre-tokenizer)
    tokenizer.add_tokens(words)
    return tokenizer


def build_tiny_model(
    vocab_size: int,
    architecture: str = "qwen2",
    hidden_size: int = 128,
    num_layers: int = 3,
    num_heads: int = 4,
    num_kv_heads: int = 4,
    intermediate_size: int = 384,
    max_position_embeddings: int = 256,
    tie_word_embeddings: bool = True,
    pad_token_id: int = 0,
    eos_token_id: int = 1,
    seed: int = 0,
):
    """A random-init Qwen2- or Llama-style causal LM of the given size (float32)."""
    families = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}
    if architecture not in families:
        raise ValueError(f"model.architecture={architecture!r} is not one of {sorted(families)}")
    config_cls, model_cls = families[architecture]
    config = config_cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        bos_token_id=eos_token_id,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = model_cls(config)
    model.generation_config.pad_token_id = pad_token_id
    model.generation_config.eos_token_id = eos_token_id
    return model
