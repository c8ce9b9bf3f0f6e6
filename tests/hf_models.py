"""Tiny Hugging Face models in the real on-disk formats, built locally (no hub at test time).

Each directory looks like a hub checkout of its family, only small: a byte-level BPE
`tokenizer.json` trained here, `tokenizer_config.json` with the family's special tokens
and chat template, `config.json`, `generation_config.json` (with the family's several EOS
ids) and `model.safetensors`. Random weights: tests check plumbing, not skill.

    qwen2    Qwen2.5-Instruct: <|im_start|>/<|im_end|> turns, eos <|im_end|>, pad <|endoftext|>,
             generation EOS ids [<|im_end|>, <|endoftext|>]
    qwen3    Qwen3: the same turns, <think>/</think> tokens, a Qwen3 config
    llama    Llama-3.2-Instruct: header tokens, eos <|eot_id|>, no pad token,
             generation EOS ids [<|end_of_text|>, <|eom_id|>, <|eot_id|>]
    qwen2_base  Qwen2 without a chat template (a base model)
"""

from __future__ import annotations

import json
from pathlib import Path

QWEN_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LLAMA_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

FAMILIES = {
    "qwen2": dict(specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], bos=None, eos="<|im_end|>",
                  pad="<|endoftext|>", generation_eos=["<|im_end|>", "<|endoftext|>"], template=QWEN_TEMPLATE,
                  architecture="qwen2"),
    "qwen2_base": dict(specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], bos=None, eos="<|endoftext|>",
                       pad="<|endoftext|>", generation_eos=["<|endoftext|>"], template=None, architecture="qwen2"),
    # Qwen3's <think> and </think> are added tokens but not special ones: decoding keeps them
    "qwen3": dict(specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], added=["<think>", "</think>"], bos=None,
                  eos="<|im_end|>", pad="<|endoftext|>", generation_eos=["<|im_end|>", "<|endoftext|>"],
                  template=QWEN_TEMPLATE, architecture="qwen3"),
    "llama": dict(specials=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                            "<|eom_id|>", "<|eot_id|>"], bos="<|begin_of_text|>", eos="<|eot_id|>", pad=None,
                  generation_eos=["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"], template=LLAMA_TEMPLATE,
                  architecture="llama"),
}

# What the tokenizer is trained on: the shapes of the text the tests feed it.
CORPUS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "How many clips did Natalia sell altogether in April and May? #### 72",
    "What is $1+2+3$? The answer is $\\boxed{6}$. Solve for x: 2x + 3 = 7, so x = 2.",
    "system user assistant You are a helpful assistant. Please reason step by step.",
    "<think> Let me think. 12 + 30 = 42 </think> The answer is 42.",
    "347+185=532 7+5=12,4+8+1=13,3+1+1=5>532 0123456789 + - * / = ( ) , . ? !",
] * 4


def build_tokenizer(family: str, vocab_size: int = 420):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    spec = FAMILIES[family]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=spec["specials"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=spec["bos"], eos_token=spec["eos"],
                                   pad_token=spec["pad"], additional_special_tokens=spec["specials"])
    fast.add_tokens(spec.get("added", []), special_tokens=False)
    if spec["template"] is not None:
        fast.chat_template = spec["template"]
    return fast


def build_model_config(family: str, tokenizer, max_positions: int):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    spec = FAMILIES[family]
    config_class = {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "llama": LlamaConfig}[spec["architecture"]]
    eos_ids = tokenizer.convert_tokens_to_ids(spec["generation_eos"])
    return config_class(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        tie_word_embeddings=spec["architecture"] != "llama",
        bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_ids if len(eos_ids) > 1 else eos_ids[0],
        pad_token_id=tokenizer.pad_token_id,
    )


def make_tiny_hf_model(directory: Path, family: str = "qwen2", max_positions: int = 512, seed: int = 0) -> Path:
    """Write a tiny ``family`` model (see the module docstring) to ``directory``; returns it."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    directory = Path(directory)
    tokenizer = build_tokenizer(family)
    config = build_model_config(family, tokenizer, max_positions)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    spec = FAMILIES[family]
    generation = GenerationConfig(bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.convert_tokens_to_ids(spec["generation_eos"]),
                                  pad_token_id=tokenizer.pad_token_id, do_sample=True, temperature=0.7)
    generation.save_pretrained(directory)
    assert (directory / "model.safetensors").is_file() and (directory / "tokenizer.json").is_file()
    return directory


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path
