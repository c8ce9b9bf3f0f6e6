"""LoRA through PEFT (`model.lora`): adapter-only training, the reference as the base with the
adapter off, every algorithm end to end, exact resume, the export, and the config rules."""

import json

import pytest
import torch
from omegaconf import open_dict

from posttrain.config.check import check_config
from posttrain.data.sources import build_source
from posttrain.errors import ConfigError
from posttrain.models.loading import load_tokenizer_and_model
from posttrain.models.lora import has_adapter
from posttrain.train import run

from forked_cli import run_command
from conftest import EASY_TASK, FAST_RUN, module_from_config

LORA = ("model.lora.r=4", "model.lora.alpha=8")
# a short online run without the SFT warm start (its export is the start of the RL run)
SHORT_RL = ("algorithm.warm_start.steps=0", "algorithm.prompts_per_step=4", "algorithm.group_size=4",
            "trainer.max_steps=2", "trainer.val_check_interval=2", "callbacks.checkpoint.every_n_train_steps=2",
            "eval.at_start=false")


def adapter_parameter_names(model) -> list[str]:
    return [name for name, p in model.named_parameters() if p.requires_grad]


def test_only_the_adapter_trains_and_its_dropout_is_kept(make_config):
    cfg = make_config(*LORA, "model.lora.dropout=0.1", "model.lora.export_merged=true")
    _, policy = load_tokenizer_and_model(cfg.model, build_source(cfg.data).alphabet)
    trainable = adapter_parameter_names(policy)
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # every attention and MLP projection of every block carries an adapter, the LM head none
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    dropouts = [m.p for name, m in policy.named_modules() if isinstance(m, torch.nn.Dropout)]
    assert dropouts and all(p == 0.1 for p in dropouts)  # LoRA's own, as configured
    assert policy.config.attention_dropout == 0.0        # the base's stays off


def test_unknown_target_module_is_a_config_error(make_config):
    cfg = make_config(*LORA, "model.lora.target_modules=[no_such_proj]", "model.lora.export_merged=true")
    with pytest.raises(ConfigError, match="model.lora.target_modules"):
        load_tokenizer_and_model(cfg.model, build_source(cfg.data).alphabet)


def test_reference_is_the_base_with_the_adapter_off(make_config, tiny_hf_model):
    base_dir = tiny_hf_model("qwen2")
    cfg = make_config(*FAST_RUN, *EASY_TASK, *SHORT_RL, *LORA, f"model.name_or_path={base_dir}", "algorithm=grpo",
                      "kl_estimator=k3")
    module = module_from_config(cfg)
    assert module.reference is None and module.frozen_roles() == []  # no copy of the weights
    assert {p for p in module.learner.policy_parameters()} == {p for p in module.policy.parameters() if p.requires_grad}
    exp, _, _ = module.collect(step=0)
    exp = module.annotate(exp.without_trailing_padding())
    mask = exp.response_mask.bool()
    with torch.no_grad():
        policy_logp = module.scoring.logprobs(module.policy, exp)
    # a fresh adapter's B is zero: the adapted policy is its base, exactly
    assert torch.equal(exp.ref_logp[mask], policy_logp[mask])

    optimizer = torch.optim.AdamW(module.learner.policy_parameters(), lr=1e-2)
    for _ in range(3):
        optimizer.zero_grad()
        logp = module.scoring.logprobs(module.policy, exp)
        (-(logp * exp.response_mask).sum()).backward()
        optimizer.step()
    with torch.no_grad():
        trained_logp = module.scoring.logprobs(module.policy, exp)
        ref_logp = module.part("reference").reference_logprobs(exp)
    assert not torch.allclose(trained_logp[mask], ref_logp[mask], atol=1e-3)
    # ... and the reference is still the base model as loaded from disk, without an adapter
    with open_dict(cfg):
        cfg.model.lora.r = None
    _, fresh_base = load_tokenizer_and_model(cfg.model, module.source.alphabet)
    assert not has_adapter(fresh_base)
    with torch.no_grad():
        base_logp = module.scoring.logprobs(fresh_base, exp)
    torch.testing.assert_close(ref_logp[mask], base_logp[mask], atol=1e-6, rtol=0)
    torch.testing.assert_close(exp.ref_logp[mask], base_logp[mask], atol=1e-6, rtol=0)


def test_ppo_critic_copies_the_base_without_the_adapter(make_config):
    cfg = make_config(*FAST_RUN, *SHORT_RL, *LORA, "model.lora.export_merged=true", "algorithm=ppo")
    module = module_from_config(cfg)
    assert has_adapter(module.policy) and not has_adapter(module.critic.lm)
    assert all(p.requires_grad for p in module.critic.lm.parameters())  # a full critic, as without LoRA
    assert all(".lora_" in n for n in adapter_parameter_names(module.policy))
    # the critic's copy starts from the policy's base weights
    base = module.policy.get_base_model().model.embed_tokens.weight
    torch.testing.assert_close(module.critic.lm.model.embed_tokens.weight, base)


def test_sft_with_a_merged_export_equals_the_adapted_policy(make_config, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = make_config(*FAST_RUN, *LORA, "model.lora.export_merged=true", "trainer.max_steps=3",
                      "trainer.val_check_interval=3", "callbacks.checkpoint.every_n_train_steps=3",
                      "eval.at_start=false", "algorithm.optim.lr=1e-2", output_dir=tmp_path / "sft")
    summary = run(cfg)
    assert summary["global_step"] == 3
    export = tmp_path / "sft/hf_model"
    assert (export / "config.json").is_file() and (export / "adapter/adapter_config.json").is_file()
    merged = AutoModelForCausalLM.from_pretrained(export).eval()
    assert not any(".lora_" in n for n, _ in merged.named_parameters())

    # the policy as trained: the config's model, with the checkpoint's weights (adapter included)
    _, policy = load_tokenizer_and_model(cfg.model, build_source(cfg.data).alphabet)
    state = torch.load(tmp_path / "sft/checkpoints/last.ckpt", weights_only=False)["state_dict"]
    policy.load_state_dict({k[len("policy."):]: v for k, v in state.items() if k.startswith("policy.")})
    lora_b = [v for k, v in state.items() if ".lora_B." in k]
    assert any(v.abs().max() > 0 for v in lora_b)  # the adapter did train
    ids = torch.randint(3, merged.config.vocab_size, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, policy.eval()(input_ids=ids).logits,
                                   atol=1e-5, rtol=1e-5)


def test_grpo_on_a_hf_model_exports_the_adapter(make_config, tiny_hf_model, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_dir = tiny_hf_model("qwen2")
    cfg = make_config(*FAST_RUN, *EASY_TASK, *SHORT_RL, *LORA, f"model.name_or_path={base_dir}", "algorithm=grpo",
                      "kl_estimator=k3", "algorithm.optim.lr=1e-2", output_dir=tmp_path / "grpo")
    summary = run(cfg)
    assert summary["global_step"] == 2 and "policy/kl" in summary
    export = tmp_path / "grpo/hf_model"
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {p.name for p in export.iterdir()}
    assert not (export / "config.json").exists()  # the adapter alone: its base is model.name_or_path
    adapter_config = json.loads((export / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(base_dir.resolve())

    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), export).eval()
    _, policy = load_tokenizer_and_model(cfg.model, build_source(cfg.data).alphabet)
    state = torch.load(tmp_path / "grpo/checkpoints/last.ckpt", weights_only=False)["state_dict"]
    policy.load_state_dict({k[len("policy."):]: v for k, v in state.items() if k.startswith("policy.")})
    ids = torch.randint(3, 200, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, policy.eval()(input_ids=ids).logits)


def test_lora_grpo_resumes_exactly(make_config, tmp_path):
    common = (*FAST_RUN, *EASY_TASK, *SHORT_RL, *LORA, "model.lora.export_merged=true", "algorithm=grpo",
              "kl_estimator=k3", "trainer.max_steps=4", "trainer.val_check_interval=100")
    run(make_config(*common, output_dir=tmp_path / "straight"))
    run(make_config(*common, "callbacks.stop_at_step=2", output_dir=tmp_path / "cut"))
    run(make_config(*common, f"ckpt_path={tmp_path}/cut/checkpoints/last.ckpt", output_dir=tmp_path / "resumed"))
    straight = torch.load(tmp_path / "straight/checkpoints/last.ckpt", weights_only=False)
    resumed = torch.load(tmp_path / "resumed/checkpoints/last.ckpt", weights_only=False)
    assert resumed["global_step"] == straight["global_step"] == 4
    adapter = [k for k in straight["state_dict"] if ".lora_" in k]
    assert adapter
    for name in adapter:
        torch.testing.assert_close(resumed["state_dict"][name], straight["state_dict"][name], atol=1e-6, rtol=0)
    # the optimiser holds the adapter's state only
    assert len(straight["optimizer_states"][0]["state"]) == len(adapter)


@pytest.mark.parametrize("overrides, culprits", [
    (("trainer=fsdp",), ("model.lora.r", "trainer=fsdp")),
    (("algorithm=sft",), ("model.lora.export_merged", "embedded tiny model")),
])
def test_unusable_lora_setups_are_refused_naming_the_keys(make_config, overrides, culprits):
    cfg = make_config(*LORA, *overrides)
    with pytest.raises(ConfigError) as refused:
        check_config(cfg)
    for culprit in culprits:
        assert culprit in str(refused.value)


def test_lora_is_off_by_default_and_allows_a_half_precision_base(make_config):
    assert make_config().model.lora.r is None
    check_config(make_config(*LORA, "model.lora.export_merged=true", "model.dtype=bfloat16"))
    with pytest.raises(ConfigError, match="model.dtype"):
        check_config(make_config("model.dtype=bfloat16"))


def test_posttrain_eval_scores_an_adapter_export_and_a_lora_checkpoint_as_training_did(make_config, sft_start,
                                                                                      tmp_path):
    """An adapter-only export is evaluated on its recorded base; a checkpoint of a LoRA policy
    loads onto a wrapped policy. Both reproduce the run's own final held-out eval."""
    import sys

    run_dir = tmp_path / "sft"
    summary = run(make_config(*FAST_RUN, *EASY_TASK, *LORA, f"model.init_from={sft_start}", "trainer.max_steps=4",
                              "trainer.val_check_interval=4", "callbacks.checkpoint.every_n_train_steps=4",
                              "eval.num_prompts=16", "eval.batch_size=16", "eval.at_start=false",
                              "algorithm.optim.lr=1e-2", output_dir=run_dir))
    assert (run_dir / "hf_model/adapter_config.json").is_file()
    for weights in (run_dir, run_dir / "checkpoints/last.ckpt"):
        log_dir = tmp_path / f"eval_{weights.name}"
        result = run_command([sys.executable, "-m", "posttrain.eval.evaluate", f"checkpoint={weights}", "num_threads=1",
                              f"paths.log_dir={log_dir}"], capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        (path,) = log_dir.glob("eval/runs/*/eval.json")
        results = json.loads(path.read_text())
        assert results["eval/accuracy"] == summary["eval/accuracy"], weights
        assert results["eval/response_len"] == summary["eval/response_len"], weights


def test_the_warm_start_trains_every_weight_and_is_shared_with_runs_without_lora(make_config):
    """The SFT warm start is the LoRA run's base: a full fine-tune, the same cache entry as the
    run without an adapter; the adapter-only export then has that entry as its base on disk."""
    from posttrain.prepare.warm_start import warm_start_plan

    from omegaconf import OmegaConf

    cfg, plain = make_config(*LORA, "algorithm=grpo"), make_config("algorithm=grpo")
    OmegaConf.resolve(cfg), OmegaConf.resolve(plain)  # as run() hands it over
    check_config(cfg)  # an adapter-only export is fine: its base is the warm start's export
    sft_cfg, target = warm_start_plan(cfg)
    assert sft_cfg.model.lora.r is None
    assert target == warm_start_plan(plain)[1]


def test_the_fast_sampler_generates_with_the_adapter_as_the_hf_loop_does(make_config):
    """rollout=fast reads a LoRA policy's adapter from its layers (base + scale * B @ A): the
    same tokens and log-probs as the generic Hugging Face loop through PEFT's own forward."""
    from posttrain.rollout import SamplingParams
    from posttrain.rollout.fast import FastSampler

    cfg = make_config(*LORA, "model.lora.dropout=0.1")
    source = build_source(cfg.data)
    tokenizer, policy = load_tokenizer_and_model(cfg.model, source.alphabet)
    torch.manual_seed(0)
    for name, parameter in policy.named_parameters():
        if ".lora_B." in name:  # a trained-looking adapter (a fresh one is B = 0: no difference)
            torch.nn.init.normal_(parameter, std=0.3)
    prompts = tokenizer(["12+34=", "5+6=", "999+1="], add_special_tokens=False, padding=True, return_tensors="pt")
    params = SamplingParams(max_new_tokens=6, temperature=0.7)
    fast, generic = FastSampler(), FastSampler(use_functional=False)
    assert fast.uses_functional_path(policy)
    outputs = [engine.generate(policy, prompts["input_ids"], prompts["attention_mask"], params,
                               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                               generator=torch.Generator().manual_seed(1)) for engine in (fast, generic)]
    torch.testing.assert_close(outputs[0].response_ids, outputs[1].response_ids, atol=0, rtol=0)
    torch.testing.assert_close(outputs[0].logprobs, outputs[1].logprobs, atol=1e-5, rtol=1e-5)
    with policy.disable_adapter():  # the base alone: other tokens
        base = fast.generate(policy, prompts["input_ids"], prompts["attention_mask"], params,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                             generator=torch.Generator().manual_seed(1))
    assert not torch.equal(base.logprobs, outputs[0].logprobs)
