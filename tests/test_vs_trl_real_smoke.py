"""benchmarks/vs_trl.py --task word_problems (the real-model path) and benchmarks/rollout_speed.py
--model / --task / --rows: both run and count consistently.

Behaviour only, on a tiny chat model in the real on-disk format (tests/hf_models.py): the
benchmarks' real model, SmolLM2-135M-Instruct, is measured by hand (benchmarks/README.md).
The vs_trl workers run in processes of their own (forked, tests/forked_cli.py), as the
benchmark runs them (the posttrain worker patches OnlineRLModule's methods and, with
--ignore-eos, the stop ids).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import load_benchmark
from forked_cli import run_command

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "vs_trl.py"
PROMPTS, GROUP, NEW_TOKENS = 2, 2, 4


@pytest.fixture(scope="module")
def vs_trl():
    return load_benchmark("vs_trl")


@pytest.fixture(scope="module")
def rollout_speed():
    return load_benchmark("rollout_speed")


def run_worker(framework: str, model_dir: Path, json_path: Path, *extra: str) -> dict:
    command = [sys.executable, str(BENCHMARK), "step", "--worker", framework, "--kl", "k3", "--model", str(model_dir),
               "--task", "word_problems", "--prompts", str(PROMPTS), "--group-size", str(GROUP),
               "--max-new-tokens", str(NEW_TOKENS), "--steps", "2", "--warmup", "0", "--threads", "1",
               "--json", str(json_path), *extra]
    finished = run_command(command, timeout=300)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    return json.loads(json_path.read_text())


@pytest.mark.parametrize("framework", ["posttrain", pytest.param("trl", marks=pytest.mark.slow)])  # trl: 7 s
def test_word_problem_workers_run_every_row_to_the_limit_and_report_the_floor(vs_trl, tiny_hf_model, tmp_path,
                                                                              framework):
    if framework == "trl":
        pytest.importorskip("trl")
    result = run_worker(framework, tiny_hf_model("qwen2"), tmp_path / "result.json", "--ignore-eos")
    assert result["framework"] == framework and result["rows_per_step"] == PROMPTS * GROUP
    assert result["max_new_tokens"] == NEW_TOKENS
    # --ignore-eos: every response is exactly the limit long, in both frameworks
    assert result["tokens"] == [PROMPTS * GROUP * NEW_TOKENS] * 2
    assert set(result["split_s"]) == set(vs_trl.SPLIT)
    for part in ("generation", "logprobs", "forward", "backward", "optimiser"):  # k3: a reference forward too
        assert all(s > 0 for s in result["split_s"][part]), part
    memory = result["memory"]
    assert memory["reference"] and memory["trainable_params"] == memory["reference_params"] > 0
    # fp32: 16 bytes per trainable parameter, 4 per reference parameter
    assert memory["floor_mb"] == pytest.approx(20 * memory["trainable_params"] / 2**20)
    assert 0 < memory["rss_after_imports_mb"] < result["peak_rss_mb"]
    if framework == "trl":  # TRL rendered the same chat messages to the same token ids
        assert result["prompt_tokens_match"] is True


def test_word_problem_defaults_are_the_issues_measurement(vs_trl):
    args = vs_trl.parse_args(["step", "--task", "word_problems"])
    assert (args.prompts, args.group_size, args.max_new_tokens, args.ignore_eos) == (2, 8, 128, False)
    args = vs_trl.parse_args(["step"])  # the arithmetic task: the benchmark's own 8 x 16, not grpo_tiny's 32 x 8
    assert (args.task, args.prompts, args.group_size, args.max_new_tokens) == ("arithmetic", 8, 16, None)
    assert (vs_trl.parse_args(["step", "--prompts", "4"]).prompts, vs_trl.parse_args(["accuracy"]).group_size) == (4, 16)
    args = vs_trl.parse_args(["accuracy", "--task", "word_problems"])  # the preset's own recipe
    assert (args.prompts, args.group_size, args.max_new_tokens, args.eval_every) == (None, None, None, 5)
    with pytest.raises(SystemExit):  # the two modes' settings differ
        vs_trl.parse_args(["all", "--task", "word_problems"])


def test_word_problem_accuracy_runs_the_real_model_preset_in_both_frameworks(vs_trl, tmp_path):
    args = vs_trl.parse_args(["accuracy", "--task", "word_problems", "--kl", "none"])
    args.model = "/some/hf_dir"
    overrides = vs_trl.posttrain_overrides(args, str(tmp_path), max_steps=3)
    assert "experiment=grpo_smollm2" in overrides and "model.name_or_path=/some/hf_dir" in overrides
    cfg = vs_trl.compose_run_config(overrides)
    assert (cfg.algorithm.prompts_per_step, cfg.algorithm.group_size, cfg.rollout.temperature) == (8, 8, 0.7)
    assert (cfg.data.source, cfg.eval.split, cfg.eval.num_prompts) == ("word_problems", "test", 128)
    assert vs_trl.trl_loss_type(cfg.algorithm.loss_agg_mode) == "dapo"  # token-mean: TRL's default
    assert vs_trl.trl_loss_type("seq-mean-token-mean") == "grpo"
    with pytest.raises(SystemExit, match="seq-mean-token-sum"):
        vs_trl.trl_loss_type("seq-mean-token-sum")


def test_word_problem_overrides_load_the_model_as_itself_on_the_task(vs_trl, tmp_path):
    args = vs_trl.parse_args(["step", "--task", "word_problems", "--max-new-tokens", "512", "--kl", "none",
                              "--host-mmap-threshold-kib", "128"])
    args.model = "/some/hf_dir"
    overrides = vs_trl.posttrain_overrides(args, str(tmp_path), max_steps=3)
    for expected in ("model.name_or_path=/some/hf_dir", "data=word_problems", "algorithm.prompts_per_step=2",
                     "algorithm.group_size=8", "data.max_response_tokens=512", "kl_estimator=none",
                     "rollout.repetition.ngram=null", "host_mmap_threshold_kib=128"):
        assert expected in overrides, expected
    assert not any(o.startswith("model.init_from=") for o in overrides)


@pytest.mark.slow  # 22 s for both; the workers' step and floor paths run in the test above
@pytest.mark.parametrize("framework", ["posttrain", "trl"])
def test_word_problem_accuracy_workers_record_a_curve_on_the_held_out_problems(tiny_hf_model, tmp_path, framework):
    if framework == "trl":
        pytest.importorskip("trl")
    json_path = tmp_path / "result.json"
    command = [sys.executable, str(BENCHMARK), "accuracy", "--worker", framework, "--kl", "none",
               "--model", str(tiny_hf_model("qwen2")), "--task", "word_problems", "--prompts", "2",
               "--group-size", "2", "--max-new-tokens", "4", "--seconds", "0.5", "--eval-every", "1",
               "--threads", "1", "--json", str(json_path)]
    finished = run_command(command, timeout=300)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    result = json.loads(json_path.read_text())
    assert result["framework"] == framework and result["rows_per_step"] == 4 and result["max_new_tokens"] == 4
    curve = result["curve"]
    assert len(curve) >= 2 and curve[0]["step"] == 0 and curve[0]["train_s"] == 0.0
    assert curve[-1]["train_s"] >= 0.5  # trained until the seconds were spent, then scored once more
    assert [p["step"] for p in curve] == sorted({p["step"] for p in curve})
    assert all(0.0 <= p["accuracy"] <= 1.0 for p in curve)


def test_step_table_prints_the_update_length_and_memory_floor(vs_trl):
    def result(framework: str, step_s: list[float], peak: float) -> dict:
        split = {part: [s / 10 for s in step_s] for part in vs_trl.PARTS}
        split["overhead"] = [s / 2 for s in step_s]
        return {"framework": framework, "kl": "none", "step_s": step_s, "split_s": split, "tokens": [64] * len(step_s),
                "peak_rss_mb": peak, "rows_per_step": 16, "prompt_tokens_match": True,
                "memory": {"reference": False, "frozen_params": 0, "frozen_requires_grad": 0, "frozen_with_grad": 0,
                           "frozen_with_optimiser_state": 0, "trainable_params": 1000, "reference_params": 0,
                           "floor_mb": 1000.0, "rss_after_imports_mb": 400.0}}

    row = vs_trl.summarise([result("posttrain", [1.0, 1.0], 2000.0), result("trl", [3.0, 3.0], 4000.0)])["none"]
    assert row["posttrain"]["update_ms"] == pytest.approx(300)  # forward + backward + optimiser
    assert row["posttrain"]["mean_response_len"] == pytest.approx(4.0)
    assert row["trl"]["peak_over_floor"] == pytest.approx(4.0)
    table = vs_trl.step_table({"none": row})
    for column in ("update", "resp len", "floor MB", "peak/flr"):
        assert column in table
    assert "1000 trainable params x 16 B" in table


def test_rollout_speed_times_fast_against_plain_generate_on_a_chat_model(rollout_speed, tiny_hf_model):
    batch, new_tokens = 4, 3
    results = rollout_speed.measure(batch=batch, new_tokens=new_tokens, repeats=2, group_size=2,
                                    model_name=str(tiny_hf_model("qwen2")), task="word_problems",
                                    rows=("fast", "generate"))
    assert list(results["rows"]) == ["fast", "generate"]
    for row in results["rows"].values():  # EOS never sampled: both run every row to the limit
        assert row["tokens"] == batch * new_tokens and len(row["seconds_all"]) == 2
    assert results["ratios"]["fast_over_generate"] > 0 and "fast_over_hf" not in results["ratios"]
    assert results["setup"]["prompts_shared"] and results["setup"]["task"] == "word_problems"
    assert results["ceiling_logprob_max_abs_diff"] is None
