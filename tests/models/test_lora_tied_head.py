"""A LoRA adapter on an LM head tied to the input embeddings (the embedded model ties them, as
Qwen2.5-0.5B does): the merged model (`models.lora.merged_copy`: the `export_merged` export and
what rollout=vllm is built from and synced with) must compute what the policy computes.

The policy's head is the shared matrix W plus the head's update and its input embeddings W alone;
merging the head's update into the shared W changed the input embeddings too (issue 44, item 5:
logits off by up to 1.7e-2 after 2 steps). The merged copy now unties them: lm_head = W + delta,
embed_tokens = W, tie_word_embeddings=false in its config."""

from __future__ import annotations

import copy
import json
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from posttrain.data.sources import build_source
from posttrain.errors import CheckpointError
from posttrain.models.loading import load_tokenizer_and_model
from posttrain.models.lora import export_model, merged_copy

from forked_cli import run_command

LORA = ("model.lora.r=4", "model.lora.alpha=8", "model.lora.export_merged=true")
HEAD = "model.lora.target_modules=[q_proj,v_proj,lm_head]"


def adapted_policy(make_config, *overrides: str):
    """(config, tokenizer, policy): the embedded model with an adapter whose zero-initialised
    factors are set to random values, as training would move them (a fresh adapter's update is
    zero: PEFT starts a linear layer's B and an embedding's A at zero)."""
    cfg = make_config(*LORA, *overrides)
    tokenizer, policy = load_tokenizer_and_model(cfg.model, build_source(cfg.data).alphabet)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if ".lora_B." in name or ".lora_embedding_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    return cfg, tokenizer, policy.eval()


def some_inputs(model) -> torch.Tensor:
    return torch.randint(3, model.config.vocab_size, (4, 12), generator=torch.Generator().manual_seed(1))


def max_logit_difference(a, b, ids) -> float:
    with torch.no_grad():
        return (a(input_ids=ids).logits - b(input_ids=ids).logits).abs().max().item()


def shares_one_weight(model) -> bool:
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


@pytest.mark.parametrize("targets", ["[q_proj,v_proj,lm_head]", "[q_proj,embed_tokens]",
                                     "[q_proj,embed_tokens,lm_head]"])
def test_the_merged_copy_and_the_export_of_a_tied_adapted_head_equal_the_policy(make_config, tmp_path, targets):
    cfg, tokenizer, policy = adapted_policy(make_config, f"model.lora.target_modules={targets}")
    base = policy.get_base_model()
    assert base.config.tie_word_embeddings
    ids = some_inputs(policy)
    embeddings_before = base.get_input_embeddings().weight.detach().clone()

    # the bug: merging into the shared matrix gives another model
    naive = copy.deepcopy(policy).merge_and_unload()
    assert max_logit_difference(naive, policy, ids) > 1e-3

    merged = merged_copy(policy).eval()
    print(f"{targets}: max |logit difference| naive merge {max_logit_difference(naive, policy, ids):.2e}, "
          f"merged copy {max_logit_difference(merged, policy, ids):.2e}")
    assert max_logit_difference(merged, policy, ids) < 1e-5
    assert not shares_one_weight(merged) and merged.config.tie_word_embeddings is False
    if "embed_tokens" not in targets:  # the input embeddings are the base's, as the policy's
        assert torch.equal(merged.get_input_embeddings().weight, embeddings_before)
    # the policy itself is untouched: still tied, its base weight unchanged
    assert base.config.tie_word_embeddings and torch.equal(base.get_input_embeddings().weight, embeddings_before)
    plain = [getattr(m, "base_layer", m) for m in (base.get_input_embeddings(), base.get_output_embeddings())]
    assert plain[0].weight is plain[1].weight

    export_model(policy, tokenizer, tmp_path / "hf_model", cfg.model)
    config = AutoConfig.from_pretrained(tmp_path / "hf_model")
    assert config.tie_word_embeddings is False
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_model").eval()
    assert not shares_one_weight(exported)
    assert max_logit_difference(exported, policy, ids) < 1e-5


def test_vllm_is_built_untied_and_synced_with_the_policys_head(make_config, tmp_path):
    """rollout=vllm builds its model from `export_model_config(plain_policy(policy))` and loads
    `plain_policy(policy).state_dict()`; vLLM skips lm_head.weight when the config ties it, so
    the config must say untied and the weights must hold the head's own matrix."""
    from posttrain.rollout.vllm import export_model_config, plain_policy

    _, _, policy = adapted_policy(make_config, HEAD)
    plain = plain_policy(policy)
    export_model_config(plain, str(tmp_path))
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is False
    weights = plain.state_dict()
    assert not torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])
    # what a worker ends with: a model built from that config, the synced weights loaded by name
    worker = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path)).eval()
    worker.load_state_dict(weights, strict=True)
    assert not shares_one_weight(worker)
    assert max_logit_difference(worker, policy, some_inputs(policy)) < 1e-5


def test_untied_embeddings_and_a_tied_head_without_an_adapter_are_merged_as_before(make_config, tmp_path):
    # untied embeddings: each weight has its own update, nothing to untie
    cfg, tokenizer, policy = adapted_policy(make_config, HEAD, "model.tie_word_embeddings=false")
    assert not shares_one_weight(policy.get_base_model())
    merged = merged_copy(policy).eval()
    assert merged.config.tie_word_embeddings is False
    assert max_logit_difference(merged, policy, some_inputs(policy)) < 1e-5
    naive = copy.deepcopy(policy).merge_and_unload()
    assert all(torch.equal(a, b) for a, b in zip(naive.state_dict().values(), merged.state_dict().values()))

    # a tied head without an adapter stays tied: one matrix in the export, tie_word_embeddings=true
    cfg, tokenizer, policy = adapted_policy(make_config, "model.lora.target_modules=[q_proj,v_proj]")
    merged = merged_copy(policy).eval()
    assert shares_one_weight(merged) and merged.config.tie_word_embeddings
    assert max_logit_difference(merged, policy, some_inputs(policy)) < 1e-5
    export_model(policy, tokenizer, tmp_path / "hf_model", cfg.model)
    assert AutoConfig.from_pretrained(tmp_path / "hf_model").tie_word_embeddings
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_model").eval()
    assert shares_one_weight(exported)
    assert max_logit_difference(exported, policy, some_inputs(policy)) < 1e-5


def test_cli_grpo_with_an_adapter_on_the_tied_head_exports_the_trained_policy(make_config, tmp_path):
    """The command of the issue, on a shorter run: the export equals the policy of the last checkpoint."""
    out = tmp_path / "run"
    result = run_command([sys.executable, "-m", "posttrain.train", "algorithm=grpo", *LORA, HEAD, "reward=format",
                          "algorithm.warm_start.steps=0", "trainer.max_steps=2", "algorithm.optim.lr=1e-2",
                          "algorithm.prompts_per_step=4", "algorithm.group_size=4", "eval.at_start=false",
                          "eval.num_prompts=16", "eval.batch_size=16", "logger=none", "callbacks.progress_bar=none",
                          f"paths.output_dir={out}", f"paths.log_dir={tmp_path / 'logs'}"],
                         capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    cfg = make_config(*LORA, HEAD)
    _, policy = load_tokenizer_and_model(cfg.model, build_source(cfg.data).alphabet)
    state = torch.load(out / "checkpoints/last.ckpt", weights_only=False)["state_dict"]
    policy.load_state_dict({k[len("policy."):]: v for k, v in state.items() if k.startswith("policy.")})
    assert any(v.abs().max() > 0 for k, v in state.items() if "lm_head.lora_B" in k)  # the head's adapter trained
    exported = AutoModelForCausalLM.from_pretrained(out / "hf_model").eval()
    difference = max_logit_difference(exported, policy.eval(), some_inputs(exported))
    print(f"CLI export vs the checkpoint's policy: max |logit difference| {difference:.2e}")
    assert difference < 1e-5
    assert exported.config.tie_word_embeddings is False


def test_an_untied_export_into_a_tied_model_is_refused_naming_the_key(make_config, tmp_path):
    # the untied export must not go into a tied model through init_from: the head and the input
    # embeddings would share one parameter, the last tensor loaded silently winning
    cfg, tokenizer, policy = adapted_policy(make_config, HEAD)
    export_model(policy, tokenizer, tmp_path / "hf_model", cfg.model)
    tied = make_config(f"model.init_from={tmp_path / 'hf_model'}")
    with pytest.raises(CheckpointError, match=r"model.init_from=.*model.tie_word_embeddings=false"):
        load_tokenizer_and_model(tied.model, build_source(tied.data).alphabet)
    untied = make_config(f"model.init_from={tmp_path / 'hf_model'}", "model.tie_word_embeddings=false")
    _, loaded = load_tokenizer_and_model(untied.model, build_source(untied.data).alphabet)
    ids = some_inputs(loaded)
    assert max_logit_difference(loaded.eval(), policy, ids) < 1e-5
