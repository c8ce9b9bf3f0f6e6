"""Inputs are checked before training: data files (encoding, prompt lengths), model
directories (tokenizer files, vocabulary size, `init_from` shapes), and the run's outputs are
group-readable with the model's context recorded in the exported tokenizer."""

import json
import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from omegaconf import OmegaConf
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from posttrain.data.datamodule import PosttrainDataModule, collate_prompts, collate_sft, sft_row_length
from posttrain.data.sources import JsonlSource, build_source
from posttrain.errors import CheckpointError, ConfigError, DataError
from posttrain.models.loading import load_initial_weights, load_pretrained
from posttrain.models.tiny import build_char_tokenizer, build_tiny_model
from posttrain.files import save_pretrained_atomic, write_json_atomic

from forked_cli import run_command

ALPHABET = "0123456789+=,>"
TINY = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64)
QUICK = ["logger=none", "callbacks.progress_bar=none", "eval.num_prompts=8", "eval.batch_size=8",
         "trainer.max_steps=2", "trainer.val_check_interval=2", "eval.at_start=false"]


# --- helpers -------------------------------------------------------------------------------

def posttrain(*args: str, log_dir: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "posttrain.train", *args, f"paths.log_dir={log_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return run_command(command, capture_output=True, text=True, timeout=300, env=env)


def assert_clean_failure(result, log_dir: Path, *needles: str) -> str:
    """Non-zero exit, every needle in the message, no traceback, no run directory left."""
    message = result.stderr + result.stdout
    assert result.returncode != 0, message
    for needle in needles:
        assert needle in message, message
    assert "Traceback" not in message, message
    assert not list(log_dir.rglob(".hydra")), "a failed start leaves no run directory"
    assert not list(log_dir.rglob("*.ckpt")) and not list(log_dir.rglob("summary.json"))
    return message


def write_jsonl(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": p, "response": "7", "answer": "7"}) + "\n" for p in prompts))
    return path


def jsonl_cfg(train: Path, validation: Path | None = None, **keys):
    return OmegaConf.create({"source": "jsonl", "files": {"train": str(train), "validation": str(validation or train),
                                                          "test": None},
                             "max_response_tokens": 8, "max_prompt_tokens": None, "truncate_prompts": None, **keys})


def datamodule(source, tokenizer, train_collate=None, eval_split="validation"):
    """SFT's data module with `train_collate=collate_sft` (its rows checked against the context)."""
    row_length = sft_row_length if train_collate is collate_sft else None
    return PosttrainDataModule(source, tokenizer, batch_size=2, train_collate=train_collate, eval_split=eval_split,
                               eval_num_prompts=8, eval_batch_size=8, sft_row_length=row_length)


def make_model_dir(directory: Path, alphabet: str = ALPHABET, vocab_size: int | None = None, pad: bool = True,
                   tokenizer_files: bool = True, architecture: str = "qwen2", context: int = 64, **sizes) -> Path:
    """A local Hugging Face model directory: a character tokenizer (optionally without a pad
    token) and a random tiny model with ``vocab_size`` embedding rows (default: the tokenizer's)."""
    chars = list(dict.fromkeys(alphabet))
    vocab = {tok: i for i, tok in enumerate(["<pad>", "<eos>", "<unk>"] + chars)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    specials = dict(eos_token="<eos>", unk_token="<unk>", **({"pad_token": "<pad>"} if pad else {}))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=core, **specials)
    model = build_tiny_model(vocab_size or len(tokenizer), architecture=architecture,
                             max_position_embeddings=context, **{**TINY, **sizes})
    model.save_pretrained(directory)
    if tokenizer_files:
        tokenizer.save_pretrained(directory)
    return directory


# --- 1. undecodable bytes ------------------------------------------------------------------

def test_undecodable_byte_names_file_line_column_and_byte(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_bytes(b'{"prompt": "1+1=", "response": "2"}\n{"prompt": "caf\xe9 1+1=", "response": "2"}\n')
    with pytest.raises(DataError) as caught:
        JsonlSource({"train": str(data)})
    message = str(caught.value)
    # line 1 is 36 bytes; the bad byte is the 16th character of line 2
    assert f"{data}:2" in message and "0xe9" in message and "column 16" in message and "byte 51" in message
    assert "UTF-8" in message


def test_byte_order_mark_is_accepted(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_bytes(b'\xef\xbb\xbf{"prompt": "1+1=", "response": "2"}\n')
    assert JsonlSource({"train": str(data)}).example("train", 0).prompt == "1+1="


def test_cli_undecodable_bytes_fail_cleanly(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_bytes(b'{"prompt": "1+1=", "response": "2"}\n\n{"prompt": "2+2=", "response": "\xff"}\n')
    result = posttrain(*QUICK, "data=jsonl", f"data.files.train={data}", f"data.files.validation={data}",
                       log_dir=tmp_path / "out")
    assert_clean_failure(result, tmp_path / "out", f"{data}:3", "0xff", "column 33", "UTF-8")


# --- 2. over-long prompts ------------------------------------------------------------------

def test_overlong_prompt_names_file_line_and_sizes(tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", ["1+2=", "3+4=", "1+" * 20 + "1="])  # line 3: 42 tokens
    source = build_source(jsonl_cfg(data))
    tokenizer = build_char_tokenizer(source.alphabet, model_max_length=32)
    with pytest.raises(DataError) as caught:
        datamodule(source, tokenizer)
    message = str(caught.value)
    assert f"{data}:3 (data.files.train)" in message
    assert "42 tokens" in message and "context of 32 tokens" in message and "max_response_tokens=8" in message
    assert "data.truncate_prompts=left" in message


def test_explicit_max_prompt_tokens_is_enforced(tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", ["1+2=", "11+22="])
    source = build_source(jsonl_cfg(data, max_prompt_tokens=5))
    with pytest.raises(DataError, match=r"train.jsonl:2 .*6 tokens, more than data.max_prompt_tokens=5"):
        datamodule(source, build_char_tokenizer(source.alphabet, model_max_length=256))


def test_left_truncation_keeps_last_tokens_and_logs_once(tmp_path, caplog):
    long_prompt = "9+" * 20 + "1="  # 42 tokens; 24 fit beside a budget of 8 in a context of 32
    train = write_jsonl(tmp_path / "train.jsonl", ["1+2=", long_prompt, long_prompt])
    validation = write_jsonl(tmp_path / "validation.jsonl", [long_prompt, "3+4="])
    source = build_source(jsonl_cfg(train, validation, truncate_prompts="left"))
    tokenizer = build_char_tokenizer(source.alphabet, model_max_length=32)
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        module = datamodule(source, tokenizer, train_collate=collate_sft)
    warnings = [r.getMessage() for r in caplog.records if "truncate_prompts" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "2 of 3 train prompts" in warnings[0] and "1 of 2 validation prompts" in warnings[0]
    assert f"{train}:2" in warnings[0] and "last 24 tokens" in warnings[0]
    expected = tokenizer(long_prompt[-24:], add_special_tokens=False)["input_ids"]
    prompts = collate_prompts(module.eval_examples, tokenizer)
    assert prompts["prompt_ids"].shape[1] == 24
    assert prompts["prompt_ids"][0].tolist() == expected
    assert source.example("validation", 0).prompt == long_prompt  # the verifier still reads the whole prompt
    rows = collate_sft([source.example("train", 1)], tokenizer)
    assert rows["input_ids"][0, :24].tolist() == expected


def test_response_budget_larger_than_context_is_a_config_error(tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", ["1+2="])
    source = build_source(jsonl_cfg(data, max_response_tokens=64))
    with pytest.raises(ConfigError, match="data.max_response_tokens=64 .*context of 64 tokens"):
        datamodule(source, build_char_tokenizer(source.alphabet, model_max_length=64))


def test_sft_row_longer_than_context_is_an_error(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "1+2=", "response": "3" * 30}) + "\n")
    source = build_source(jsonl_cfg(data))
    with pytest.raises(DataError, match=r"train.jsonl:1 .*training row .* is 35 tokens, more than the model's context of 32"):
        datamodule(source, build_char_tokenizer(source.alphabet, model_max_length=32), train_collate=collate_sft)
    datamodule(source, build_char_tokenizer(source.alphabet, model_max_length=32))  # RL reads prompts only


def test_generated_prompts_are_checked_against_the_context():
    cfg = OmegaConf.create({"source": "arithmetic", "min_digits": 3, "max_digits": 3, "num_operands": 2,
                            "style": "concise", "seed": 0, "max_response_tokens": 8, "max_prompt_tokens": None})
    source = build_source(cfg)  # prompts like "347+185=": 8 tokens
    datamodule(source, build_char_tokenizer(source.alphabet, model_max_length=16))
    with pytest.raises(DataError, match="8 tokens, more than the 7 tokens .*context of 15 tokens.*Generated"):
        datamodule(source, build_char_tokenizer(source.alphabet, model_max_length=15))


def test_bad_truncate_option_is_a_config_error(tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", ["1+2="])
    with pytest.raises(ConfigError, match="data.truncate_prompts='right'"):
        build_source(jsonl_cfg(data, truncate_prompts="right"))
    with pytest.raises(ConfigError, match="data.max_prompt_tokens=0"):
        build_source(jsonl_cfg(data, max_prompt_tokens=0))


def test_cli_overlong_prompt_fails_cleanly(tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", ["1+2=", "3+4=", "5+" * 40 + "6="])  # line 3: 82 tokens
    result = posttrain(*QUICK, "data=jsonl", f"data.files.train={data}", f"data.files.validation={data}",
                       "model.max_position_embeddings=64", log_dir=tmp_path / "out")
    assert_clean_failure(result, tmp_path / "out", f"{data}:3", "82 tokens", "context of 64 tokens",
                         "data.max_response_tokens=32", "data.truncate_prompts=left")


# --- 3. model directories and init_from ----------------------------------------------------

def test_directory_without_tokenizer_files_names_the_files(tmp_path):
    directory = make_model_dir(tmp_path / "no_tokenizer", tokenizer_files=False)
    with pytest.raises(CheckpointError) as caught:
        load_pretrained(str(directory), "model.name_or_path")
    message = str(caught.value)
    assert str(directory) in message and "tokenizer.json" in message and "tokenizer.model" in message


def test_tokenizer_larger_than_embeddings_names_both_sizes(tmp_path):
    directory = make_model_dir(tmp_path / "small_vocab", vocab_size=10)  # the tokenizer has 17 tokens
    with pytest.raises(CheckpointError) as caught:
        load_pretrained(str(directory), "model.name_or_path")
    message = str(caught.value)
    assert str(directory) in message and "17 tokens" in message and "10 rows" in message


def test_missing_pad_token_is_reported_once(tmp_path, caplog):
    # (a qwen2 directory would get Qwen2Tokenizer's default pad token added, outside the vocabulary)
    directory = make_model_dir(tmp_path / "no_pad", pad=False, architecture="llama")
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        tokenizer, _ = load_pretrained(str(directory), "model.name_or_path")
        load_pretrained(str(directory), "model.name_or_path")
    assert tokenizer.pad_token == "<eos>"
    warnings = [r.getMessage() for r in caplog.records if "pad token" in r.getMessage()]
    assert len(warnings) == 1 and str(directory) in warnings[0] and "'<eos>'" in warnings[0]


def test_init_from_directory_of_another_size_names_tensor_and_shapes(tmp_path):
    directory = make_model_dir(tmp_path / "wide", hidden_size=64)
    model = build_tiny_model(17, max_position_embeddings=64, **TINY)
    with pytest.raises(CheckpointError) as caught:
        load_initial_weights(model, str(directory))
    message = str(caught.value)
    assert f"model.init_from={str(directory)!r}" in message
    assert "model.embed_tokens.weight" in message and "[17, 64]" in message and "[17, 32]" in message


def test_init_from_directory_of_another_architecture_is_named(tmp_path):
    directory = make_model_dir(tmp_path / "llama", architecture="llama")
    model = build_tiny_model(17, max_position_embeddings=64, **TINY)
    with pytest.raises(CheckpointError, match="holds a llama model.*qwen2"):
        load_initial_weights(model, str(directory))


def test_init_from_checkpoint_of_another_size_names_tensor_and_shapes(tmp_path):
    other = build_tiny_model(17, **{**TINY, "intermediate_size": 48})
    checkpoint = tmp_path / "other.ckpt"
    torch.save({"state_dict": {f"policy.{k}": v for k, v in other.state_dict().items()}}, checkpoint)
    model = build_tiny_model(17, **TINY)
    with pytest.raises(CheckpointError, match=r"other.ckpt.*mlp.gate_proj.weight is \[48, 32\] there but \[64, 32\]"):
        load_initial_weights(model, str(checkpoint), key="roles.critic.init_from")


def test_cli_directory_without_tokenizer_fails_cleanly(tmp_path):
    directory = make_model_dir(tmp_path / "no_tokenizer", tokenizer_files=False)
    result = posttrain(*QUICK, "model=hf", f"model.name_or_path={directory}", log_dir=tmp_path / "out")
    assert_clean_failure(result, tmp_path / "out", str(directory), "tokenizer.json")


def test_cli_init_from_other_shape_fails_cleanly(tmp_path):
    directory = make_model_dir(tmp_path / "wide", hidden_size=64)
    result = posttrain(*QUICK, "model.hidden_size=32", "model.num_layers=1", "model.intermediate_size=64",
                       f"model.init_from={directory}", log_dir=tmp_path / "out")
    assert_clean_failure(result, tmp_path / "out", str(directory), "model.embed_tokens.weight", "[17, 64]",
                         "[17, 32]")


# --- 4./5. group-readable outputs and the exported context ---------------------------------

def group_readable(path: Path) -> bool:
    return bool(path.stat().st_mode & stat.S_IRGRP)


def test_write_json_atomic_uses_the_umask_mode(tmp_path):
    old = os.umask(0o022)
    try:
        write_json_atomic(tmp_path / "summary.json", {"a": 1})
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "summary.json").stat().st_mode) == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]  # no temporary left
    with pytest.raises(TypeError):
        write_json_atomic(tmp_path / "bad.json", {"a": object()})
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_hf_export_records_the_context_and_is_group_readable(tmp_path):
    directory = make_model_dir(tmp_path / "source", context=48)
    tokenizer, model = load_pretrained(str(directory), "model.name_or_path")
    assert tokenizer.model_max_length == 48
    save_pretrained_atomic(model, tokenizer, tmp_path / "hf_model")
    assert json.loads((tmp_path / "hf_model" / "tokenizer_config.json").read_text())["model_max_length"] == 48
    assert all(group_readable(p) for p in (tmp_path / "hf_model").iterdir())


def test_short_run_outputs_are_group_readable_with_context(make_config, tmp_path):
    from posttrain.train import run

    run(make_config(*QUICK, "model.max_position_embeddings=128"))
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    names = {p.name for p in files}
    assert {"summary.json", "config.yaml", "last.ckpt", "model.safetensors", "tokenizer_config.json"} <= names
    assert [str(p) for p in files if not group_readable(p)] == []
    exported = json.loads((tmp_path / "hf_model" / "tokenizer_config.json").read_text())
    assert exported["model_max_length"] == 128
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "hf_model").model_max_length == 128
