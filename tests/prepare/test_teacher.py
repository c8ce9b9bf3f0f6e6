"""The `teacher` key: every kind of value becomes an HF directory in roles.teacher.name_or_path
(a model directory as it is, a run or checkpoint exported once, an embedded recipe trained
once and cached), and a teacher whose tokenizer is not the policy's is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from posttrain.data.arithmetic import ALPHABET
from posttrain.errors import ConfigError
from posttrain.train import run
from posttrain.prepare.teachers import longest_response_tokens, recipe_plan, resolve_teacher, tokenizer_difference
from posttrain.models.tiny import build_char_tokenizer, build_tiny_model

from conftest import FAST_RUN, compose_config

SMALL_MODEL = ("model.hidden_size=32", "model.num_layers=1", "model.intermediate_size=64")
# the embedded recipe, in seconds: a small model, a few steps, no accuracy target
QUICK_RECIPE = ("teacher_recipe.steps=5", "teacher_recipe.until_accuracy=null", "teacher_recipe.model.hidden_size=32",
                "teacher_recipe.model.num_layers=1", "teacher_recipe.model.intermediate_size=64")


def policy_tokenizer():
    """The embedded policy's tokenizer on the embedded task."""
    return build_char_tokenizer(ALPHABET)


def resolved(tmp_path: Path, *overrides: str):
    """(directory, config) after resolving the teacher of `posttrain <overrides>`."""
    cfg = compose_config([*FAST_RUN, *overrides, f"paths.cache_dir={tmp_path / 'cache'}"], tmp_path / "run")
    OmegaConf.resolve(cfg)  # as run() does
    return resolve_teacher(cfg, policy_tokenizer(), train=run), cfg


def policy_weights(checkpoint: Path) -> dict:
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)["state_dict"]
    return {k[len("policy."):]: v for k, v in state.items() if k.startswith("policy.")}


def same_weights(hf_dir: str, expected: dict) -> bool:
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(hf_dir).state_dict()
    return all(torch.equal(loaded[name], tensor) for name, tensor in expected.items())


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory) -> Path:
    """A run directory of a 2-step SFT run of a small embedded model (hf_model/ and checkpoints/)."""
    from posttrain.train import run

    out = tmp_path_factory.mktemp("teacher_run")
    run(compose_config([*FAST_RUN, *SMALL_MODEL, "trainer.max_steps=2", "trainer.val_check_interval=2",
                        "callbacks.checkpoint.every_n_train_steps=2", "eval.at_start=false"], out))
    return out


def test_no_teacher_resolves_to_nothing(tmp_path):
    directory, cfg = resolved(tmp_path)
    assert directory is None and cfg.roles.teacher.name_or_path is None


def test_an_hf_directory_is_the_teacher_as_it_is(tmp_path):
    tokenizer = policy_tokenizer()
    model = build_tiny_model(len(tokenizer), hidden_size=32, num_layers=1, intermediate_size=64)
    model.save_pretrained(tmp_path / "teacher")
    tokenizer.save_pretrained(tmp_path / "teacher")
    directory, cfg = resolved(tmp_path, f"teacher={tmp_path / 'teacher'}")
    assert directory == str((tmp_path / "teacher").resolve())
    assert cfg.roles.teacher.name_or_path == directory and cfg.roles.teacher.init_from is None
    assert not (tmp_path / "cache").exists()  # nothing made


def test_a_run_directory_gives_its_export(tmp_path, sft_run):
    directory, _ = resolved(tmp_path, f"teacher={sft_run}")
    assert directory == str(sft_run / "hf_model")


def test_a_checkpoint_is_exported_once(tmp_path, sft_run, monkeypatch):
    checkpoint = sft_run / "checkpoints" / "last.ckpt"
    directory, cfg = resolved(tmp_path, f"teacher={checkpoint}")
    assert Path(directory).is_relative_to((tmp_path / "cache").resolve())
    assert cfg.roles.teacher.name_or_path == directory
    assert same_weights(directory, policy_weights(checkpoint))  # the checkpoint's policy, as an HF model

    import posttrain.models.lora as lora

    def no_export(*args, **kwargs):
        raise AssertionError("exported again")

    monkeypatch.setattr(lora, "export_model", no_export)
    assert resolved(tmp_path, f"teacher={checkpoint}")[0] == directory  # read from the cache


def test_a_run_directory_without_an_export_gives_its_last_checkpoint(tmp_path, sft_run):
    run_dir = tmp_path / "stopped_run"  # stopped before its export: config.yaml and checkpoints only
    shutil.copytree(sft_run, run_dir, ignore=shutil.ignore_patterns("hf_model"))
    directory, _ = resolved(tmp_path, f"teacher={run_dir}")
    assert same_weights(directory, policy_weights(run_dir / "checkpoints" / "last.ckpt"))


def test_a_missing_path_is_refused(tmp_path):
    missing = tmp_path / "no_such_teacher"
    with pytest.raises(ConfigError, match=r"teacher=.*no_such_teacher.*no such file or directory"):
        resolved(tmp_path, f"teacher={missing}")


def test_a_teacher_named_twice_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"teacher='tiny_concise' and roles.teacher.name_or_path='/x' both name"):
        resolved(tmp_path, "teacher=tiny_concise", "roles.teacher.name_or_path=/x")
    assert not (tmp_path / "cache").exists()  # refused before anything is trained


def test_a_teacher_with_another_tokenizer_is_refused_naming_the_token(tmp_path, tiny_hf_model):
    foreign = tiny_hf_model("qwen2")
    with pytest.raises(ConfigError) as caught:
        resolved(tmp_path, f"teacher={foreign}")
    message = str(caught.value)
    assert "teacher=" in message and str(foreign) in message and "embedded tiny model" in message
    # the embedded tokenizer's first token (id 0) is its pad token, which a BPE vocabulary lacks
    assert "token '<pad>' is id 0 in the policy's tokenizer but absent in the teacher's" in message


def test_the_first_differing_token_is_named():
    policy = build_char_tokenizer("0123456789+=,>")
    assert tokenizer_difference(policy, build_char_tokenizer("0123456789+=,>")) is None
    # ids: 3 specials, then the characters in order: ',' is 15 in one, '>' takes 15 in the other
    swapped = build_char_tokenizer("0123456789+=>,")
    assert tokenizer_difference(policy, swapped) == ("token ',' is id 15 in the policy's tokenizer "
                                                     "but id 16 in the teacher's")
    larger = build_char_tokenizer("0123456789+=,>-")
    assert tokenizer_difference(policy, larger) == ("token '-' (id 17) of the teacher's tokenizer "
                                                    "is absent from the policy's")


def test_the_recipes_budget_fits_the_longest_solution(make_config):
    cfg = make_config("data.style=verbose")
    # 999+999: "9+9=18,9+9+1=19,9+9+1=19>1998" is 29 characters, then EOS
    assert longest_response_tokens(cfg.data) == 30
    cfg = make_config("data.style=concise", "data.num_operands=3", "data.max_digits=4")
    assert longest_response_tokens(cfg.data) == len("29997") + 1


def test_a_recipe_is_shared_by_every_run_of_the_task(make_config):
    def plan(*overrides):
        cfg = make_config(*overrides)
        OmegaConf.resolve(cfg)
        return recipe_plan(cfg, cfg.teacher)

    concise, target = plan("teacher=tiny_concise")
    assert concise.data.style == "concise" and concise.model.hidden_size == 256
    # the RL run's algorithm, seed and own model do not change the teacher
    assert plan("teacher=tiny_concise", "algorithm=grpo", "seed=3", "model.hidden_size=64")[1] == target
    verbose, verbose_target = plan("teacher=tiny_verbose")
    assert verbose.data.style == "verbose" and verbose.data.max_response_tokens == 30 and verbose_target != target
    assert plan("teacher=tiny_concise", "data.max_digits=4")[1] != target  # another task, another teacher


def test_an_embedded_recipe_is_trained_once_then_read_from_the_cache(tmp_path, monkeypatch):
    directory, cfg = resolved(tmp_path, "teacher=tiny_verbose", *QUICK_RECIPE)
    assert Path(directory).is_relative_to((tmp_path / "cache" / "teacher").resolve())
    assert json.loads((Path(directory) / "config.json").read_text())["hidden_size"] == 32  # teacher_recipe.model
    assert cfg.roles.teacher.name_or_path == directory and cfg.roles.teacher.init_from is None

    import posttrain.prepare.warm_start as warm_start

    def no_training(*args):
        raise AssertionError("trained again")

    monkeypatch.setattr(warm_start, "train_warm_start", no_training)
    assert resolved(tmp_path, "teacher=tiny_verbose", *QUICK_RECIPE, "seed=7")[0] == directory
    assert len(list((tmp_path / "cache" / "teacher").iterdir())) == 1  # the entry alone: no lock, no scratch


def test_a_recipe_needs_the_embedded_task(tmp_path):
    with pytest.raises(ConfigError, match=r"teacher='tiny_concise'.*data.source='jsonl'"):
        resolved(tmp_path, "teacher=tiny_concise", "data=jsonl", "data.files.train=x.jsonl")
