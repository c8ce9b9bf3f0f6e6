"""Two loss terms of the online update beside the policy loss, end to end: PPO-ptx on pretraining
text (algorithm.ptx_data: its gradient, its logged loss, its checkpointed position) and the
entropy bonus (algorithm.entropy_coef: it changes the update)."""

import json
from pathlib import Path

import pytest
import torch
from conftest import rl_config
from test_online import random_online_module, scored_batch
from transformers import AutoModelForCausalLM

from posttrain.train import run


def write_corpus(directory: Path, lines: int = 200) -> Path:
    """Pretraining text the embedded tokenizer can read: one sum a line ("12+30=42")."""
    path = directory / "corpus.txt"
    path.write_text("".join(f"{i % 50}+{i % 7}={i % 50 + i % 7}\n" for i in range(lines)))
    return path


def metrics_lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_ptx_on_pretraining_text_adds_the_language_model_gradient(make_config, tmp_path):
    """The update's gradient is the RL terms' plus ptx_coef times that of the mean next-token
    loss on chunks of the text, computed here by hand from the policy's logits."""
    coef, rows = 0.5, 4
    module = random_online_module(make_config, f"algorithm.ptx_coef={coef}",
                                  f"algorithm.ptx_data={write_corpus(tmp_path)}", "algorithm.ptx_seq_len=12",
                                  f"algorithm.ptx_batch_size={rows}")
    exp = scored_batch(module)
    params = [p for p in module.policy.parameters() if p.requires_grad]

    def gradients(ptx_coef: float):
        module.part("ptx").coef, module.part("ptx").cursor.position = ptx_coef, 0
        module.policy.zero_grad(set_to_none=True)
        stats = module.learner.accumulate_gradients(exp)
        return stats, [p.grad.clone() for p in params]

    with_ptx, combined = gradients(coef)
    assert module.part("ptx").cursor.position == rows  # one batch of chunks taken from the stream
    without_ptx, rl_only = gradients(0.0)
    assert "ptx/loss" in with_ptx and "ptx/loss" not in without_ptx

    module.part("ptx").cursor.position = 0
    chunks = torch.stack(module.part("ptx").cursor.take(rows))  # the same chunks: [rows, 12] token ids
    assert chunks.shape == (rows, 12)
    module.policy.zero_grad(set_to_none=True)
    logits = module.policy(input_ids=chunks).logits
    logp = torch.log_softmax(logits[:, :-1].double(), dim=-1).gather(-1, chunks[:, 1:, None]).squeeze(-1)
    lm_loss = -logp.mean()  # every token after the first of each chunk, equally weighted
    (coef * lm_loss).backward()
    assert with_ptx["ptx/loss"] == pytest.approx(float(lm_loss.detach()), rel=1e-5)
    for g_combined, g_rl, p in zip(combined, rl_only, params):
        torch.testing.assert_close(g_combined - g_rl, p.grad, rtol=1e-4, atol=1e-6)


def test_an_online_run_with_ptx_on_a_text_file_logs_a_falling_ptx_loss(make_config, sft_start, tmp_path):
    corpus = write_corpus(tmp_path)
    steps, rows = 8, 8
    summary = run(rl_config(make_config, sft_start, "algorithm=grpo", "algorithm.ptx_coef=1.0",
                            f"algorithm.ptx_data={corpus}", "algorithm.ptx_seq_len=32",
                            f"algorithm.ptx_batch_size={rows}", "algorithm.optim.lr=1e-3",
                            "algorithm.optim.warmup_steps=0", "algorithm.entropy_coef=0.01",
                            f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps}",
                            f"callbacks.checkpoint.every_n_train_steps={steps}", output_dir=tmp_path / "run"))
    losses = [line["ptx/loss"] for line in metrics_lines(tmp_path / "run") if "ptx/loss" in line]
    assert summary["global_step"] == steps and len(losses) == steps  # one ptx batch per optimiser step
    assert losses[-1] < losses[0] - 0.1, losses  # the language model learns the text
    # the stream's position is checkpointed: a resume reads on from the next chunk
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)
    assert checkpoint["ptx_position"] == steps * rows


def test_a_missing_ptx_file_is_refused_at_start_up(make_config, sft_start, tmp_path):
    from posttrain.errors import ConfigError

    with pytest.raises(ConfigError, match="algorithm.ptx_data=.*no such file"):
        run(rl_config(make_config, sft_start, "algorithm=grpo", "algorithm.ptx_coef=1.0",
                      f"algorithm.ptx_data={tmp_path / 'missing.txt'}", output_dir=tmp_path / "run"))
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_the_entropy_bonus_changes_the_update(make_config, sft_start, tmp_path):
    """The same seed, so the same first rollout batch: with entropy_coef > 0 the step differs
    from the one without, and the next batch is sampled from a policy of higher entropy."""
    runs = {}
    for coef in (0.0, 1.0):
        out = tmp_path / f"entropy_{coef}"
        run(rl_config(make_config, sft_start, "algorithm=grpo", f"algorithm.entropy_coef={coef}",
                      "algorithm.optim.lr=1e-3", "algorithm.optim.warmup_steps=0", "trainer.max_steps=2",
                      output_dir=out))
        train_lines = [line for line in metrics_lines(out) if "policy/entropy" in line]
        weights = AutoModelForCausalLM.from_pretrained(out / "hf_model").state_dict()
        runs[coef] = train_lines, weights
    (plain_lines, plain), (bonus_lines, bonus) = runs[0.0], runs[1.0]
    for key in ("rollout/reward_mean", "rollout/response_len_mean"):
        assert plain_lines[0][key] == bonus_lines[0][key], key  # the first batch: the same samples and policy
    # The same entropy of the same policy, summed in another order: a logged entropy is
    # core/head_logprobs.py's, a weighted one autograd's chunk (core/logprobs.py).
    assert plain_lines[0]["policy/entropy"] == pytest.approx(bonus_lines[0]["policy/entropy"], rel=1e-6)
    assert any(not torch.equal(plain[name], bonus[name]) for name in plain)
    assert bonus_lines[1]["policy/entropy"] > plain_lines[1]["policy/entropy"]
