"""Real Hugging Face models (issue 13): `model=hf` and the hub presets, every EOS id of the
model stopping generation, the pad token of Llama-shaped tokenizers, fp32 master weights,
gradient checkpointing, and the memory check that refuses a model too large before loading
it. Tiny local directories in the real on-disk formats stand in for hub checkouts
(tests/hf_models.py)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from posttrain.algorithms.base import PosttrainModule
from posttrain.config.check import check_config
from posttrain.errors import ConfigError
from posttrain.estimate import memory
from posttrain.models import loading
from posttrain.models.loading import load_tokenizer_and_model, stop_token_ids
from posttrain.rollout import SamplingParams
from posttrain.train import run

from conftest import FAST_RUN, compose_config
from hf_models import FAMILIES, write_jsonl

PRESETS = {
    "qwen2.5_0.5b_instruct": "Qwen/Qwen2.5-0.5B-Instruct",
    "qwen2.5_1.5b_instruct": "Qwen/Qwen2.5-1.5B-Instruct",
    "qwen3_0.6b": "Qwen/Qwen3-0.6B",
    "llama3.2_1b_instruct": "meta-llama/Llama-3.2-1B-Instruct",
}


def model_cfg(directory, *overrides: str):
    return compose_config(["model=hf", f"model.name_or_path={directory}", *overrides]).model


def refusal(*overrides: str, choices: dict | None = None) -> str:
    cfg = compose_config(list(overrides))
    OmegaConf.resolve(cfg)
    with pytest.raises(ConfigError) as caught:
        check_config(cfg, choices or {})
    return str(caught.value)


# --- loading and stop tokens --------------------------------------------------------------

@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_loads_from_a_local_directory_and_stops_on_every_eos(family, tiny_hf_model):
    directory = tiny_hf_model(family)
    tokenizer, model = load_tokenizer_and_model(model_cfg(directory), alphabet="")
    assert model.config.model_type == FAMILIES[family]["architecture"]
    assert next(model.parameters()).dtype == torch.float32  # model=hf keeps fp32 master weights
    assert tokenizer.pad_token_id is not None and tokenizer.padding_side == "left"
    declared = json.loads((directory / "generation_config.json").read_text())["eos_token_id"]
    declared = declared if isinstance(declared, list) else [declared]
    stops = stop_token_ids(tokenizer, model)
    assert stops[0] == tokenizer.eos_token_id and set(stops) == {tokenizer.eos_token_id, *declared}
    assert len(stops) == len(set(stops))
    assert model.generation_config.eos_token_id == stops  # recorded once, exported with the model


def test_llama_stop_ids_are_all_three_end_tokens(tiny_hf_model):
    tokenizer, model = load_tokenizer_and_model(model_cfg(tiny_hf_model("llama")), alphabet="")
    expected = tokenizer.convert_tokens_to_ids(["<|eot_id|>", "<|end_of_text|>", "<|eom_id|>"])
    assert stop_token_ids(tokenizer, model) == expected


def biased_towards(model: nn.Module, token_id: int) -> nn.Module:
    """`model` with an LM head whose bias makes `token_id` the argmax at every position."""
    head = nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        head.bias[token_id] = 1e4
    model.lm_head = head
    return model


@pytest.mark.parametrize("engine", ["fast", "hf"])
def test_generation_stops_at_an_eos_id_that_is_not_the_tokenizers(engine, tiny_hf_model):
    tokenizer, model = load_tokenizer_and_model(model_cfg(tiny_hf_model("llama")), alphabet="")
    eom = tokenizer.convert_tokens_to_ids("<|eom_id|>")  # 2nd EOS of generation_config; the tokenizer's is eot
    assert eom != tokenizer.eos_token_id
    biased_towards(model, eom)
    module = PosttrainModule(model, tokenizer, source=None, optim=None, rollout=OmegaConf.create({"engine": engine}),
                             eval_max_new_tokens=6)
    prompts = tokenizer(["What is 2+3?", "Hi"], return_tensors="pt", padding=True)
    params = SamplingParams(max_new_tokens=6, greedy=True)

    stopped = module.generate(prompts["input_ids"], prompts["attention_mask"], params)
    assert stopped.response_ids[:, 0].tolist() == [eom, eom]
    assert stopped.response_mask.sum(dim=1).tolist() == [1, 1] and not stopped.truncated.any()
    # the same model, stopping only at the tokenizer's EOS, runs on to the budget
    unstopped = module.engine.generate(model, prompts["input_ids"], prompts["attention_mask"], params,
                                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    assert unstopped.response_mask.sum(dim=1).tolist() == [6, 6] and unstopped.truncated.all()


def test_llama_tokenizer_without_pad_pads_with_eos_and_says_so_once(tiny_hf_model, caplog, monkeypatch):
    directory = tiny_hf_model("llama")
    assert json.loads((directory / "tokenizer_config.json").read_text()).get("pad_token") is None  # as on the hub
    monkeypatch.setattr(loading, "_PAD_WARNED", set())  # other tests may have loaded it already
    with caplog.at_level(logging.WARNING, logger="posttrain.models.loading"):
        for _ in range(2):  # the policy, then a role or the warm start's model
            tokenizer, _model = load_tokenizer_and_model(model_cfg(directory), alphabet="")
    assert tokenizer.pad_token == "<|eot_id|>" and tokenizer.pad_token_id == tokenizer.eos_token_id
    said = [r.getMessage() for r in caplog.records if "no pad token" in r.getMessage()]
    assert len(said) == 1 and "<|eot_id|>" in said[0]
    batch = tokenizer(["1", "12+30=42"], padding=True, return_tensors="pt")
    assert batch["input_ids"][0, 0] == tokenizer.eos_token_id and batch["attention_mask"][0, 0] == 0  # left-padded


# --- end to end ---------------------------------------------------------------------------

def test_sft_through_run_on_a_local_llama_directory(tiny_hf_model, make_config, tmp_path):
    directory = tiny_hf_model("llama")
    records = [{"prompt": f"What is {a}+{b}?", "response": f"{a}+{b}={a + b}", "answer": str(a + b)}
               for a, b in [(1, 2), (12, 30), (7, 5), (40, 2)]]
    data = write_jsonl(tmp_path / "train.jsonl", records)
    summary = run(make_config(*FAST_RUN, "model=hf", f"model.name_or_path={directory}", "algorithm=sft",
                              "algorithm.batch_size=2", "data=jsonl", f"data.files.train={data}",
                              f"data.files.validation={data}", "data.max_response_tokens=8", "trainer.max_steps=2",
                              "trainer.val_check_interval=2", "callbacks.checkpoint.every_n_train_steps=2",
                              "eval.num_prompts=2", "eval.batch_size=2", "eval.max_new_tokens=4",
                              output_dir=tmp_path / "run"))
    assert summary["global_step"] == 2 and "eval/accuracy" in summary
    exported = json.loads((tmp_path / "run" / "hf_model" / "generation_config.json").read_text())
    declared = json.loads((directory / "generation_config.json").read_text())["eos_token_id"]
    assert set(declared) <= set(exported["eos_token_id"])  # the export stops where the model does


def test_model_hf_without_a_name_is_refused_by_run(make_config):
    with pytest.raises(ConfigError, match=r"model=hf needs model\.name_or_path"):
        run(make_config("model=hf", *FAST_RUN))


# --- presets and config rules ---------------------------------------------------------------

@pytest.mark.parametrize("preset,hub_id", sorted(PRESETS.items()))
def test_presets_compose_and_name_their_hub_ids_without_loading(preset, hub_id, monkeypatch):
    import transformers

    def no_loading(*args, **kwargs):
        raise AssertionError("the config check must not load a model")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_loading)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", no_loading)
    cfg = compose_config([f"model={preset}"])
    OmegaConf.resolve(cfg)
    check_config(cfg, {"model": preset})
    assert cfg.model.name_or_path == hub_id and cfg.model.dtype == "float32"


def test_pure_bf16_trainable_weights_are_refused_unless_allowed(tiny_hf_model):
    named = f"model.name_or_path={tiny_hf_model('qwen2')}"
    message = refusal("model=hf", named, "model.dtype=bfloat16")
    assert "model.dtype='bfloat16'" in message and "bf16-mixed" in message and "allow_low_precision_weights" in message
    assert "trainer.precision='bf16-true'" in refusal("model=hf", named, "trainer.precision=bf16-true")
    for allowed in (("model.allow_low_precision_weights=true",), ("trainer=fsdp",)):  # fsdp upcasts to fp32
        cfg = compose_config(["model=hf", named, "model.dtype=bfloat16", *allowed])
        OmegaConf.resolve(cfg)
        check_config(cfg, {"model": "hf"})


def test_embedded_model_settings_next_to_a_pretrained_model_are_refused(tiny_hf_model):
    message = refusal("model=hf", f"model.name_or_path={tiny_hf_model('qwen2')}", "model.hidden_size=64")
    assert "model.hidden_size=64 would be ignored" in message


# --- precision and gradient checkpointing -----------------------------------------------------

def gradients(model: nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    model.train()
    model.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def recomputes(model: nn.Module) -> bool:
    """Whether HF gradient checkpointing is on (its decoder sets this flag)."""
    return any(getattr(module, "gradient_checkpointing", False) is True for module in model.modules())


@pytest.mark.parametrize("mode", ["true", "selective"])
def test_gradient_checkpointing_gives_the_same_gradients(tiny_hf_model, mode):
    directory = tiny_hf_model("qwen2")
    _, plain = load_tokenizer_and_model(model_cfg(directory), alphabet="")
    tokenizer, checkpointed = load_tokenizer_and_model(model_cfg(directory, f"model.gradient_checkpointing={mode}"),
                                                       alphabet="")
    assert recomputes(checkpointed) and not recomputes(plain)
    layer = next(m for m in checkpointed.modules() if getattr(m, "gradient_checkpointing", False) is True)
    assert ("context_fn" in layer._gradient_checkpointing_func.keywords) == (mode == "selective")
    ids = tokenizer(["What is 12+30? The answer is 42.", "Natalia sold clips to 48 of her friends."],
                    padding="max_length", truncation=True, max_length=16, return_tensors="pt")["input_ids"]
    expected, got = gradients(plain, ids), gradients(checkpointed, ids)
    assert expected.keys() == got.keys() and len(got) > 0
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-5, rtol=1e-5, msg=name)


# --- the memory check -----------------------------------------------------------------------

def parameters_of(directory) -> int:
    _, model = load_tokenizer_and_model(model_cfg(directory), alphabet="")
    return sum(p.numel() for p in model.parameters())


def with_device_memory(monkeypatch, free: float) -> None:
    monkeypatch.setattr(memory, "device_memory", lambda cfg: (int(free), "the test device has"))


def test_parameters_are_counted_from_the_config_alone(tiny_hf_model):
    for family in ("qwen2", "llama"):  # tied and untied embeddings
        directory = tiny_hf_model(family)
        assert memory.parameter_count(str(directory)) == parameters_of(directory)


def test_a_model_too_large_for_the_device_fails_before_loading(tiny_hf_model, make_config, monkeypatch, tmp_path):
    directory = tiny_hf_model("qwen2")
    parameters = parameters_of(directory)
    needed = 16 * parameters  # fp32 weights, gradients and AdamW's two moments (SFT: no reference)
    with_device_memory(monkeypatch, needed * 0.5)

    def no_loading(*args, **kwargs):
        raise AssertionError("weights were loaded before the memory check")

    monkeypatch.setattr(loading, "load_pretrained", no_loading)
    with pytest.raises(ConfigError) as caught:
        run(make_config(*FAST_RUN, "model=hf", f"model.name_or_path={directory}", "algorithm=sft",
                        output_dir=tmp_path / "run"))
    message = str(caught.value)
    assert str(directory) in message and f"{parameters:,} parameters" in message
    assert memory.size(needed) in message and memory.size(needed * 0.5) in message and "does not fit" in message


def test_a_model_near_the_device_memory_warns_and_one_that_fits_passes(tiny_hf_model, monkeypatch, caplog):
    directory = tiny_hf_model("qwen2")
    cfg = compose_config(["model=hf", f"model.name_or_path={directory}", "algorithm=sft"])
    needed = 16 * parameters_of(directory)
    with caplog.at_level(logging.WARNING, logger="posttrain.estimate.memory"):
        with_device_memory(monkeypatch, needed / 0.9)
        memory.check_memory_fits(cfg)
        assert len(caplog.records) == 1 and "90%" in caplog.records[0].getMessage()
        with_device_memory(monkeypatch, needed / 0.5)
        memory.check_memory_fits(cfg)
        assert len(caplog.records) == 1  # nothing new


def test_the_estimate_counts_the_reference_and_a_bf16_reference_halves_it(tiny_hf_model):
    directory = tiny_hf_model("qwen2")
    parameters = parameters_of(directory)
    grpo = ["model=hf", f"model.name_or_path={directory}", "algorithm=grpo"]  # k3 KL: a frozen reference
    roles = memory.role_estimates(compose_config(grpo))
    assert [(r.role, r.bytes) for r in roles] == [("policy", 16 * parameters), ("reference", 4 * parameters)]
    bf16 = memory.role_estimates(compose_config([*grpo, "roles.reference.dtype=bfloat16"]))
    assert bf16[1].bytes == 2 * parameters
    sharded = memory.role_estimates(compose_config([*grpo, "trainer=fsdp", "trainer.devices=4"]))
    assert [r.bytes for r in sharded] == [4 * parameters, 1 * parameters]  # each process holds a quarter


def test_a_pretrained_policy_gets_no_sft_warm_start(make_config, tiny_hf_model):
    """The warm start's settings are the embedded model's; a pretrained policy starts as it is."""
    from omegaconf import OmegaConf

    from posttrain.prepare.warm_start import warm_start_plan

    embedded = make_config("algorithm=grpo")
    pretrained = make_config("algorithm=grpo", "model=hf", f"model.name_or_path={tiny_hf_model('qwen2')}")
    OmegaConf.resolve(embedded), OmegaConf.resolve(pretrained)  # as run() hands them over
    assert warm_start_plan(embedded) is not None
    assert warm_start_plan(pretrained) is None
