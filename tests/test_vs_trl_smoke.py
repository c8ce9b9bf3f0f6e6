"""benchmarks/vs_trl.py: its workers run and report every measurement; its summaries are right.

Behaviour only: speed is measured by the benchmark itself, never asserted in tests. The
workers run in processes of their own (forked, tests/forked_cli.py), as the benchmark runs
them (the posttrain worker patches OnlineRLModule's methods for timing, which must not leak
into other tests).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest
from conftest import load_benchmark
from forked_cli import run_command

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "vs_trl.py"


@pytest.fixture(scope="module")
def vs_trl():
    return load_benchmark("vs_trl")


def run_worker(framework: str, kl: str, model_dir: Path, json_path: Path, *extra: str) -> dict:
    command = [sys.executable, str(BENCHMARK), "step", "--worker", framework, "--kl", kl, "--model", str(model_dir),
               "--steps", "3", "--warmup", "1", "--threads", "1", "--json", str(json_path), *extra]
    finished = run_command(command, timeout=300)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    return json.loads(json_path.read_text())


def check_worker_result(vs_trl, result: dict, framework: str, kl: str) -> None:
    assert result["framework"] == framework and result["kl"] == kl
    assert len(result["step_s"]) == 3 and len(result["tokens"]) == 3  # warm-up step dropped
    assert set(result["split_s"]) == set(vs_trl.SPLIT)
    for part, seconds in result["split_s"].items():
        assert len(seconds) == 3, part
    for part in ("generation", "forward", "backward", "optimiser"):  # every wrapped method was hit each step
        assert all(s > 0 for s in result["split_s"][part]), part
    for i, step in enumerate(result["step_s"]):  # the split adds up to the step
        assert sum(result["split_s"][part][i] for part in vs_trl.SPLIT) == pytest.approx(step)
        assert sum(result["split_s"][part][i] for part in vs_trl.PARTS) <= step
    assert all(tokens > 0 for tokens in result["tokens"])
    assert result["peak_rss_mb"] > 0
    memory = result["memory"]
    # a reference model (and its forward) only with the KL term
    assert memory["reference"] is (kl == "k3")
    assert (memory["frozen_params"] > 0) is (kl == "k3")
    if kl == "k3":
        assert all(s > 0 for s in result["split_s"]["logprobs"])
    assert memory["frozen_with_grad"] == 0 and memory["frozen_with_optimiser_state"] == 0


# without KL: the same worker less the reference (slow, as the one of TRL)
WITH_AND_WITHOUT_KL = ["k3", pytest.param("none", marks=pytest.mark.slow)]


@pytest.mark.parametrize("kl", WITH_AND_WITHOUT_KL)
def test_posttrain_worker_reports_steps_split_and_memory(vs_trl, embedded_hf_model, tmp_path, kl):
    result = run_worker("posttrain", kl, embedded_hf_model, tmp_path / "result.json")
    check_worker_result(vs_trl, result, "posttrain", kl)
    assert result["memory"]["frozen_requires_grad"] == 0  # posttrain freezes its reference


@pytest.mark.parametrize("kl", WITH_AND_WITHOUT_KL)
def test_trl_worker_reports_steps_split_and_memory(vs_trl, embedded_hf_model, tmp_path, kl):
    pytest.importorskip("trl")
    result = run_worker("trl", kl, embedded_hf_model, tmp_path / "result.json")
    check_worker_result(vs_trl, result, "trl", kl)
    if kl == "none":  # on-policy without a reference: TRL runs no forward without gradient
        assert result["split_s"]["logprobs"] == [0.0, 0.0, 0.0]


# TRL's own micro-batching is TRL's (14 s, slow); posttrain's split runs in CI
@pytest.mark.parametrize("framework", ["posttrain", pytest.param("trl", marks=pytest.mark.slow)])
def test_a_micro_batch_size_splits_each_update_into_that_many_rows(vs_trl, embedded_hf_model, tmp_path, framework):
    pytest.importorskip("trl")
    whole = run_worker(framework, "none", embedded_hf_model, tmp_path / "whole.json")
    split = run_worker(framework, "none", embedded_hf_model, tmp_path / "split.json", "--micro-batch-size", "32")
    rows = whole["rows_per_step"]
    assert rows == split["rows_per_step"] and rows % 32 == 0 and rows > 32
    assert whole["calls"]["backward"] == [1, 1, 1]  # one backward per step, over every row
    assert split["calls"]["backward"] == [rows // 32] * 3  # one per micro-batch, one optimiser step
    assert split["calls"]["optimiser"] == whole["calls"]["optimiser"]


@pytest.mark.parametrize("framework", ["posttrain", "trl"])
def test_a_micro_batch_size_that_does_not_divide_the_rows_is_refused(embedded_hf_model, tmp_path, framework):
    pytest.importorskip("trl")
    command = [sys.executable, str(BENCHMARK), "step", "--worker", framework, "--kl", "none", "--model",
               str(embedded_hf_model), "--micro-batch-size", "48", "--json", str(tmp_path / "r.json")]
    finished = run_command(command, timeout=300)
    assert finished.returncode != 0
    assert "--micro-batch-size 48 must divide the 128 rows of a step (8 prompts x 16 samples)" in finished.stderr
    assert not (tmp_path / "r.json").exists()


def worker_result(framework: str, kl: str, step_s: list[float], rss: float = 100.0) -> dict:
    split = {part: [0.0] * len(step_s) for part in ("generation", "logprobs", "forward", "backward", "optimiser")}
    split["generation"] = [s / 2 for s in step_s]
    split["overhead"] = [s / 2 for s in step_s]
    return {"framework": framework, "kl": kl, "step_s": step_s, "split_s": split, "tokens": [10] * len(step_s),
            "peak_rss_mb": rss,
            "memory": {"reference": kl == "k3", "frozen_params": 5, "frozen_requires_grad": 0, "frozen_with_grad": 0,
                       "frozen_with_optimiser_state": 0}}


def test_summarise_gives_medians_ranges_and_both_ratios(vs_trl):
    results = [  # two repeats of each framework, one KL setting
        worker_result("posttrain", "k3", [0.1, 0.2, 0.3], rss=100),  # repeat median 200 ms
        worker_result("trl", "k3", [0.3, 0.3, 0.3], rss=300),        # 300 ms
        worker_result("trl", "k3", [1.0, 1.0, 1.0], rss=500),        # 1000 ms
        worker_result("posttrain", "k3", [0.4, 0.4, 0.4], rss=200),  # 400 ms
    ]
    row = vs_trl.summarise(results)["k3"]
    assert row["posttrain"]["step_ms"] == pytest.approx(300)       # median of 200 and 400
    assert row["posttrain"]["step_ms_range"] == pytest.approx([200, 400])
    assert row["trl"]["step_ms"] == pytest.approx(650)
    assert row["trl"]["step_ms_range"] == pytest.approx([300, 1000])
    assert row["posttrain"]["split_ms"]["generation"] == pytest.approx(150)
    assert row["posttrain"]["split_ms"]["forward"] == 0
    assert row["posttrain"]["peak_rss_mb"] == pytest.approx(150)
    assert row["trl"]["tokens_per_s"] == pytest.approx(statistics.median([30 / 0.9, 30 / 3.0]))
    # per repeat: 300 / 200 = 1.5 and 1000 / 400 = 2.5
    assert row["ratio"]["median_of_repeat_ratios"] == pytest.approx(2.0)
    assert row["ratio"]["ratio_of_medians"] == pytest.approx(650 / 300)
    assert "kl=k3" in vs_trl.step_table({"k3": row})


def test_accuracy_summary_finds_when_posttrain_reaches_trls_final_accuracy(vs_trl):
    def curve(*points):
        return [{"train_s": t, "step": i, "accuracy": a} for i, (t, a) in enumerate(points)]

    curves = {"posttrain": [curve((0, 0.2), (10, 0.4), (20, 0.6)), curve((0, 0.2), (12, 0.6), (22, 0.6))],
              "trl": [curve((0, 0.2), (30, 0.4)), curve((0, 0.2), (31, 0.6))]}
    summary = vs_trl.summarise_accuracy(curves)
    assert summary["trl"]["final_accuracy"] == pytest.approx(0.5)
    # posttrain's mean: 0.2 from 0 s, 0.3 from 10 s, 0.5 from 12 s (both seeds have run to 20 s)
    assert [p["accuracy"] for p in summary["posttrain"]["mean_curve"]] == pytest.approx([0.2, 0.3, 0.5, 0.6])
    assert summary["posttrain_reaches_trl_final_s"] == 12
    assert summary["trl_total_s"] == pytest.approx(30.5)


def test_combine_reads_worker_files_and_earlier_summaries(vs_trl, tmp_path):
    """--combine: seeds run apart (TRL's with other memory options) are summarised as one race."""
    import json

    def curve(*points):
        return [{"train_s": t, "step": i, "accuracy": a} for i, (t, a) in enumerate(points)]

    earlier = tmp_path / "accuracy.json"
    earlier.write_text(json.dumps({"curves": {"posttrain": [curve((0, 0.2), (10, 0.5))],
                                              "trl": [curve((0, 0.2), (40, 0.3))]}}))
    workers = []
    for framework, points in (("posttrain", ((0, 0.2), (12, 0.6))), ("trl", ((0, 0.2), (38, 0.5)))):
        workers.append(tmp_path / f"{framework}.json")
        workers[-1].write_text(json.dumps({"framework": framework, "curve": curve(*points)}))
    curves = vs_trl.combined_curves([str(earlier), *map(str, workers)])
    assert [len(curves[framework]) for framework in ("posttrain", "trl")] == [2, 2]
    assert vs_trl.summarise_accuracy(curves)["trl"]["final_accuracy"] == pytest.approx(0.4)
    with pytest.raises(SystemExit, match="no curve of trl"):
        vs_trl.combined_curves([str(workers[0])])


def test_bf16_mixed_is_asked_of_posttrain_only_with_the_option_on_the_cpu(vs_trl):
    import argparse

    def overrides(precision: str, device: str = "cpu") -> list[str]:
        args = argparse.Namespace(mode="step", kl="k3", device=device, model="m", threads=1, seed=0,
                                  precision=precision, rollout="fast")
        return vs_trl.posttrain_overrides(args, "out", 3)

    assert "trainer.precision=bf16-mixed" in overrides("bf16-mixed")
    assert not any(o.startswith("trainer.precision") for o in overrides("fp32"))
    # the scale path has its own precision (FSDP2's bf16 gathers); the CPU option does not add to it
    assert not any(o.startswith("trainer.precision") for o in overrides("bf16-mixed", device="cuda"))
