"""posttrain-estimate (the estimate/ package): its counts against built models and the autograd
graph of the real training forward, how its terms scale, and the command line.

Its memory and time predictions against measured runs: benchmarks/estimate_vs_measured.py
(docs/estimate.md)."""

from __future__ import annotations

import json

import pytest
import torch
from gguf_files import real
from held_tensors import OpOutputs

from posttrain.core import cost
from posttrain.estimate import batch, command, speed
from posttrain.estimate.estimator import composed_config, estimate

GRPO = ["algorithm=grpo", "algorithm.warm_start.steps=0"]


def estimated(overrides: list[str], tmp_path, **options):
    cfg = composed_config([*overrides, f"paths.cache_dir={tmp_path}"])
    return estimate(cfg, with_seconds=False, **options)


def test_the_embedded_models_parameters_are_those_of_the_built_model(tmp_path):
    from posttrain.data.sources import build_source
    from posttrain.models.loading import load_tokenizer_and_model

    cfg = composed_config([*GRPO, "kl_estimator=k3", f"paths.cache_dir={tmp_path}"])
    result = estimate(cfg, with_seconds=False)
    _, model = load_tokenizer_and_model(cfg.model, build_source(cfg.data).alphabet)
    built = sum(p.numel() for p in model.parameters())
    assert [r["role"] for r in result.roles] == ["policy", "reference"]
    assert all(r["parameters"] == built for r in result.roles)
    assert result.memory["update"]["policy weights"] == 4 * built  # float32


def test_the_activations_are_those_the_training_forward_saves_for_its_backward(tmp_path):
    """The update's activations and fused weight copies against the tensors that autograd
    saves in the real grouped forward of the embedded model (each storage once)."""
    from posttrain.models.forward import sequence_logprobs
    from posttrain.models.tiny import build_tiny_model

    prompts, group, prompt_tokens, response_tokens = 2, 8, 8, 48
    result = estimated([*GRPO, f"algorithm.prompts_per_step={prompts}", f"algorithm.group_size={group}"], tmp_path,
                       prompt_tokens=prompt_tokens, response_tokens=response_tokens)
    shape = result.shape
    model = build_tiny_model(vocab_size=shape["vocab"])
    assert sum(p.numel() for p in model.parameters()) == result.roles[0]["parameters"]
    rows = prompts * group
    generator = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(3, shape["vocab"], (prompts, prompt_tokens), generator=generator)
    response_ids = torch.randint(3, shape["vocab"], (rows, response_tokens), generator=generator)
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def keep(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        sequence_logprobs(model, prompt_ids.repeat_interleave(group, 0), torch.ones(rows, prompt_tokens),
                          response_ids, torch.ones(rows, response_tokens), with_entropy=True, entropy_grad=False)
    predicted = result.memory["update"]["activations"] + result.memory["update"]["fused weight copies"]
    assert predicted == pytest.approx(sum(saved.values()), rel=0.1)


def test_selective_checkpointing_activations_are_what_the_forward_leaves_held(tmp_path):
    """model.gradient_checkpointing=selective: the update's activations against the bytes that
    the real grouped forward of the embedded model leaves alive for its backward (every op's
    output still referenced once the forward returns: autograd's saved tensors and the
    checkpoint's kept matmul outputs; each storage once, parameters aside)."""
    from posttrain.distributed.recompute import enable_activation_checkpointing
    from posttrain.models.forward import sequence_logprobs
    from posttrain.models.tiny import build_tiny_model

    prompts, group, prompt_tokens, response_tokens = 2, 8, 8, 48
    result = estimated([*GRPO, f"algorithm.prompts_per_step={prompts}", f"algorithm.group_size={group}",
                        "model.gradient_checkpointing=selective"], tmp_path,
                       prompt_tokens=prompt_tokens, response_tokens=response_tokens)
    assert result.checkpointing == "selective"
    model = build_tiny_model(vocab_size=result.shape["vocab"])
    enable_activation_checkpointing(model, "selective")
    rows = prompts * group
    generator = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(3, result.shape["vocab"], (prompts, prompt_tokens), generator=generator)
    response_ids = torch.randint(3, result.shape["vocab"], (rows, response_tokens), generator=generator)
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with OpOutputs() as outputs:
        logp = sequence_logprobs(model, prompt_ids.repeat_interleave(group, 0), torch.ones(rows, prompt_tokens),
                                 response_ids, torch.ones(rows, response_tokens))
    held = outputs.held_bytes(skip=(logp,), excluded_storages=parameters)
    kept = result.activations
    assert kept["with checkpointing"] < kept["with selective checkpointing"] < kept["without checkpointing"]
    # the forward leaves every layer's kept tensors; the backward adds one layer's full activations
    # while it recomputes that layer, which the estimate counts too
    shape = cost.DecoderShape(**result.shape)
    recomputed_layer = cost.layer_activation_bytes(shape, prompts, prompt_tokens, rows, response_tokens, 4)
    assert result.memory["update"]["activations"] - recomputed_layer == pytest.approx(held, rel=0.15)


def test_doubling_the_batch_doubles_activations_and_kv_cache_and_leaves_the_weights(tmp_path):
    one, two = (estimated([*GRPO, f"algorithm.prompts_per_step={n}"], tmp_path, prompt_tokens=10) for n in (4, 8))
    assert two.memory["generate"]["KV cache"] == 2 * one.memory["generate"]["KV cache"]
    for checkpointing in ("without checkpointing", "with checkpointing"):
        assert two.activations[checkpointing] == 2 * one.activations[checkpointing]
    assert two.memory["update"]["fused weight copies"] == one.memory["update"]["fused weight copies"]
    assert two.memory["update"]["policy weights"] == one.memory["update"]["policy weights"]
    assert two.flops["update"] > 1.9 * one.flops["update"]


def test_a_token_budget_sizes_the_micro_batch_by_full_rows(tmp_path):
    """algorithm.micro_batch_tokens: as many full rows (prompt + every response token) as the
    budget holds, at least one; the tighter of it and micro_batch_size wins."""
    rows = [*GRPO, "algorithm.prompts_per_step=4", "algorithm.group_size=8"]  # 32 rows of 10 + 50 tokens
    whole = estimated(rows, tmp_path, prompt_tokens=10, response_tokens=50)
    budget = estimated([*rows, "algorithm.micro_batch_tokens=500"], tmp_path, prompt_tokens=10, response_tokens=50)
    assert (whole.batch["micro_rows"], whole.batch["micro_batches"]) == (32, 1)
    assert (budget.batch["micro_rows"], budget.batch["micro_batches"]) == (8, 4)  # 500 // 60
    assert budget.batch["micro_prompts"] == 1  # one whole group a micro-batch: its prompt runs once
    assert budget.memory["update"]["activations"] == pytest.approx(whole.memory["update"]["activations"] / 4, rel=0.05)
    tiny = estimated([*rows, "algorithm.micro_batch_tokens=10"], tmp_path, prompt_tokens=10, response_tokens=50)
    assert tiny.batch["micro_rows"] == 1 and tiny.batch["micro_batches"] == 32  # a row over the budget runs alone
    both = estimated([*rows, "algorithm.micro_batch_tokens=500", "algorithm.micro_batch_size=4"], tmp_path,
                     prompt_tokens=10, response_tokens=50)
    assert both.batch["micro_rows"] == 4


def test_checkpointing_keeps_less_and_costs_a_forward_more(tmp_path):
    plain = estimated(GRPO, tmp_path, prompt_tokens=10)
    checkpointed = estimated([*GRPO, "model.gradient_checkpointing=true"], tmp_path, prompt_tokens=10)
    assert checkpointed.checkpointing and not plain.checkpointing
    assert checkpointed.activations == plain.activations  # both are shown, whichever is on
    assert checkpointed.memory["update"]["activations"] < plain.memory["update"]["activations"] / 2
    assert checkpointed.flops["update"] == pytest.approx(4 / 3 * plain.flops["update"])


def test_fsdp_over_two_devices_halves_the_sharded_terms(tmp_path):
    one, two = (estimated([*GRPO, "trainer=fsdp", f"trainer.devices={n}"], tmp_path, prompt_tokens=10)
                for n in (1, 2))
    for term in ("policy weights", "policy gradients", "policy AdamW moments"):
        stage = "update" if term != "policy gradients" else None
        for memory_one, memory_two in ((one.memory[s], two.memory[s]) for s in (stage, "update") if s):
            if term in memory_one:
                assert memory_two[term] == memory_one[term] / 2, term
    assert two.memory["generate"]["KV cache"] == one.memory["generate"]["KV cache"]  # per device: its own rows
    assert "gathered policy weights" in two.memory["generate"]  # the sampler reads the whole weights


def test_the_optimiser_and_frozen_roles_follow_the_config(tmp_path):
    without_kl = estimated([*GRPO, "kl_estimator=none"], tmp_path, prompt_tokens=10)
    bf16_reference = estimated([*GRPO, "kl_estimator=k3", "roles.reference.dtype=bfloat16"], tmp_path, prompt_tokens=10)
    assert "reference weights" not in without_kl.memory["update"]
    assert "annotate" not in without_kl.memory  # on-policy without a reference: no scoring forward
    reference = bf16_reference.memory["update"]["reference weights"]
    assert reference == 2 * bf16_reference.roles[1]["parameters"]
    policy = bf16_reference.memory["update"]["policy weights"]
    assert bf16_reference.memory["update"]["policy AdamW moments"] == 2 * policy
    assert "reference forward" in bf16_reference.flops and "reference forward" not in without_kl.flops


def test_a_pretrained_model_is_estimated_from_its_config_without_reading_its_weights(embedded_hf_model, tmp_path,
                                                                                    monkeypatch):
    import safetensors
    import safetensors.torch

    def refuse(*args, **kwargs):
        raise AssertionError("posttrain-estimate read a weights file")

    for module, name in ((safetensors, "safe_open"), (safetensors.torch, "load_file"), (torch, "load")):
        monkeypatch.setattr(module, name, refuse)
    result = estimated([*GRPO, "model=hf", f"model.name_or_path={embedded_hf_model}"], tmp_path)
    assert result.model == str(embedded_hf_model)
    assert result.roles[0]["parameters"] == estimated(GRPO, tmp_path).roles[0]["parameters"]  # the same tiny model
    assert result.batch["prompt_tokens"] > 0  # found from the data with its tokenizer


def test_the_command_prints_the_tables_and_json(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(speed, "measure_cpu", lambda threads, dtype: {"name": "stub", "flops": 1e9,
                                                                         "bandwidth": 1e9})
    command.main([*GRPO, f"paths.cache_dir={tmp_path}"])
    out = capsys.readouterr().out
    for heading in ("parameters per role", "memory per device by stage", "peak:", "lower bounds on seconds"):
        assert heading in out
    command.main([*GRPO, f"paths.cache_dir={tmp_path}", "--json", "--device", "h100"])
    result = json.loads(capsys.readouterr().out)
    assert list(result["seconds"]) == ["h100"]
    assert result["peak"]["peak"] == max(v for k, v in result["peak"].items() if k != "peak")
    assert result["seconds"]["h100"]["step"] == pytest.approx(sum(v for k, v in result["seconds"]["h100"].items()
                                                                  if k != "step"))


def test_this_cpu_keeps_its_best_reading_and_a_busy_reading_does_not_replace_it(tmp_path, monkeypatch):
    readings = iter([{"flops": 100e9, "bandwidth": 8e9},   # idle
                     {"flops": 30e9, "bandwidth": 9e9},    # busy matmuls, a better copy
                     {"flops": 120e9, "bandwidth": 2e9},   # a better matmul, a busy copy
                     {"flops": 250e9, "bandwidth": 1e9}])  # bf16 matmuls, a slow copy

    def measured(threads, dtype):
        return {"name": f"stub {dtype}", **next(readings)}

    monkeypatch.setattr(speed, "measure_cpu", measured)
    assert speed.cpu_speed(tmp_path) == {"name": "stub torch.float32", "flops": 100e9, "bandwidth": 8e9}
    assert speed.cpu_speed(tmp_path)["flops"] == 100e9  # the busy reading is not kept ...
    assert speed.cpu_speed(tmp_path) == {"name": "stub torch.float32", "flops": 120e9, "bandwidth": 9e9}  # each best
    kept = json.loads((tmp_path / "estimate" / "cpu_speed.json").read_text())
    assert [value for value in kept.values()] == [{"name": "stub torch.float32", "flops": 120e9, "bandwidth": 9e9}]
    # a bf16 run is bounded by the bf16 matmul speed, kept apart from fp32's
    assert speed.cpu_speed(tmp_path, torch.bfloat16)["flops"] == 250e9
    assert len(json.loads((tmp_path / "estimate" / "cpu_speed.json").read_text())) == 2


@pytest.mark.parametrize(("arguments", "message"), [
    (["algorithm.no_such_key=1"], "no_such_key"),
    (["algorithm=grpoo"], "config group algorithm has no option 'grpoo'"),
    (["trainer.max_steps=abc"], "trainer.max_steps"),
    (["--device", "tpu"], "--device='tpu'"),
])
def test_a_bad_argument_is_one_error_line_and_exit_1(arguments, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        command.main([*GRPO, f"paths.cache_dir={tmp_path}", *arguments])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("posttrain-estimate: error:") and message in err and "Traceback" not in err


@real
def test_smollm2_is_estimated_from_its_config_alone(tmp_path, monkeypatch):
    import safetensors

    monkeypatch.setattr(safetensors, "safe_open", lambda *args, **kwargs: pytest.fail("read a weights file"))
    result = estimated(["experiment=grpo_smollm2"], tmp_path)
    assert result.roles[0]["parameters"] == 134_515_008
    assert result.shape["layers"] == 30 and result.shape["kv_heads"] == 3


def test_a_critic_with_its_own_backbone_trains_beside_the_policy(tmp_path):
    result = estimated(["algorithm=ppo", "algorithm.warm_start.steps=0"], tmp_path, prompt_tokens=10)
    assert "critic" in [r["role"] for r in result.roles] and "critic" in result.flops
    update = result.memory["update"]
    assert update["critic activations"] > 0 and update["critic AdamW moments"] == 2 * update["critic weights"]


def test_a_pretrained_model_with_a_given_prompt_length_reads_no_data(embedded_hf_model, tmp_path, monkeypatch):
    from posttrain.errors import DataError

    def unreachable(data_cfg):
        raise DataError("data.path='some/hub_dataset' could not be loaded")

    monkeypatch.setattr(batch, "build_source", unreachable)
    overrides = [*GRPO, "model=hf", f"model.name_or_path={embedded_hf_model}"]
    assert estimated(overrides, tmp_path, prompt_tokens=12).batch["prompt_tokens"] == 12
    with pytest.raises(DataError, match="--prompt-tokens N"):
        estimated(overrides, tmp_path)
