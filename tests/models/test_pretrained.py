"""`model=hf model.name_or_path=<dir>`: a local directory shaped like a hub model (config.json,
safetensors weights, a byte-level BPE tokenizer.json without a pad token) trains with SFT
and GRPO exactly as a hub id would where a hub is reachable."""

import json

import pytest
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from posttrain.train import run

from conftest import FAST_RUN


@pytest.fixture(scope="module")
def hub_shaped_model_dir(tmp_path_factory):
    """A Qwen2-style model directory as `save_pretrained` writes it for a hub model."""
    corpus = [f"{a}+{b}={a + b}" for a in range(0, 200, 7) for b in range(0, 200, 11)]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    # like many hub models: an EOS but no pad token (the loader must pick one)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
    config = transformers.Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                                      eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True)
    directory = tmp_path_factory.mktemp("hub_model") / "Qwen2-tiny-local"
    transformers.Qwen2ForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    assert (directory / "model.safetensors").is_file() and (directory / "tokenizer.json").is_file()
    return directory


QUICK = (*FAST_RUN, "model=hf", "model.dtype=float32", "data.min_digits=2", "data.max_digits=2",
         "trainer.max_steps=3", "trainer.val_check_interval=3", "callbacks.checkpoint.every_n_train_steps=3",
         "eval.num_prompts=8", "eval.batch_size=8")


@pytest.mark.parametrize("algorithm", ["sft", "grpo"])
def test_local_hub_shaped_directory_trains_and_exports(algorithm, hub_shaped_model_dir, make_config, tmp_path):
    overrides = [*QUICK, f"model.name_or_path={hub_shaped_model_dir}", f"algorithm={algorithm}"]
    if algorithm == "grpo":
        overrides += ["algorithm.warm_start.steps=0", "algorithm.prompts_per_step=2", "algorithm.group_size=2"]
    summary = run(make_config(*overrides))
    assert summary["global_step"] == 3 and "eval/accuracy" in summary
    exported = tmp_path / "hf_model"
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(exported)
    assert reloaded.config.vocab_size == json.loads((hub_shaped_model_dir / "config.json").read_text())["vocab_size"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    assert tokenizer.pad_token is not None and tokenizer.decode(tokenizer("12+34=")["input_ids"]) == "12+34="
