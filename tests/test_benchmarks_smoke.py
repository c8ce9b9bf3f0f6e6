"""benchmarks/rollout_speed.py runs and counts tokens consistently.

Behaviour only: speed is measured by the benchmark itself, never asserted in tests.
"""

from __future__ import annotations

import json

import pytest
from conftest import load_benchmark


@pytest.fixture(scope="module")
def rollout_speed():
    return load_benchmark("rollout_speed")


def test_measure_reports_every_row_with_consistent_token_counts(rollout_speed):
    batch, new_tokens = 4, 4
    results = rollout_speed.measure(batch=batch, new_tokens=new_tokens, repeats=1)
    rows = results["rows"]
    assert set(rows) == {"fast", "fast_hf_loop", "hf", "ceiling"}
    for name, row in rows.items():
        assert row["tokens_per_s"] > 0, name
        assert len(row["seconds_all"]) == 1, name
    # the default EOS is never sampled, so every engine generates the full budget ...
    for name in ("fast", "fast_hf_loop", "hf"):
        assert rows[name]["tokens"] == batch * new_tokens, name
    # ... and the ceiling forward scores exactly the tokens fast generated, reproducing
    # fast's log-probs (it is the same computation over the same tokens)
    assert rows["ceiling"]["tokens"] == rows["fast"]["tokens"]
    assert results["ceiling_logprob_max_abs_diff"] < 1e-3
    assert results["ratios"]["fast_over_hf"] > 0 and results["ratios"]["ceiling_over_fast"] > 0
    assert isinstance(results["targets"]["fast_over_hf_met"], bool)


def test_grid_measures_every_cell_and_marks_shared_prompts(rollout_speed, tmp_path, capsys):
    """--grid through the command line: one cell per (batch, new tokens), each with the fast,
    hf and ceiling rows and its own consistency check; --group-size repeats the prompts."""
    import json

    import torch

    out = tmp_path / "grid.json"
    argv = ["--grid", "--grid-batches", "2", "4", "--grid-new-tokens", "2", "--repeats", "1",
            "--group-size", "2", "--threads", str(torch.get_num_threads()), "--json", str(out)]
    grid = rollout_speed.main(argv)
    assert json.loads(out.read_text())["cells"][1]["setup"]["batch"] == 4
    assert "2x2 shared" in capsys.readouterr().out
    assert [(c["setup"]["batch"], c["setup"]["new_tokens"]) for c in grid["cells"]] == [(2, 2), (4, 2)]
    for cell in grid["cells"]:
        setup, rows = cell["setup"], cell["rows"]
        assert set(rows) == {"fast", "hf", "ceiling"}  # the HF loop only with --with-hf-loop
        assert setup["distinct_prompts"] == setup["batch"] // 2 and setup["prompts_shared"]
        for name in ("fast", "hf"):
            assert rows[name]["tokens"] == setup["batch"] * setup["new_tokens"], name
        assert rows["ceiling"]["tokens"] == rows["fast"]["tokens"]
        assert cell["ceiling_logprob_max_abs_diff"] < 1e-3
    # no batch-64 cell here, so no target reading; the fall-off list names cells of the grid
    assert grid["target"]["ceiling_over_fast"] == {}
    assert all(cell in ([2, 2], [4, 2]) for cell in grid["target"]["cells_over"])


def test_distinct_prompts_are_not_shared_and_a_group_must_divide_the_batch(rollout_speed):
    cell = rollout_speed.measure(batch=2, new_tokens=2, repeats=1, with_hf_loop=False)
    assert cell["setup"]["distinct_prompts"] == 2 and not cell["setup"]["prompts_shared"]
    assert set(cell["rows"]) == {"fast", "hf", "ceiling"}
    with pytest.raises(ValueError, match="group-size 3 .* divide every batch"):
        rollout_speed.measure_grid(batches=[6, 4], new_tokens=[2], repeats=1, group_size=3)


def test_mismatch_benchmark_finds_no_gap_in_fp32_and_one_in_bf16(tmp_path, capsys):
    """benchmarks/mismatch.py on the tiny model (random init): the fp32 sampler's log-probs are
    the trainer's up to rounding; the bf16 sampler's differ, and the table says by how much."""
    import json

    mismatch = load_benchmark("mismatch")
    out = tmp_path / "mismatch.json"
    results = mismatch.main(["--prompts", "2", "--group-size", "2", "--max-new-tokens", "6", "--seeds", "0,1",
                             "--threads", "1", "--json", str(out)])
    assert json.loads(out.read_text())["rows"].keys() == {"float32", "bfloat16"}
    fp32, bf16 = results["rows"]["float32"], results["rows"]["bfloat16"]
    assert fp32["tokens"] > 0 and bf16["tokens"] > 0
    assert fp32["abs_log_ratio_max"] < 1e-4 and fp32["kl"] < 1e-9
    assert bf16["abs_log_ratio_max"] > 1e-3 and bf16["kl"] > fp32["kl"]
    assert "| bfloat16 |" in capsys.readouterr().out


def test_async_rollouts_benchmark_reads_throughput_and_curves_from_a_run(tmp_path):
    """benchmarks/async_rollouts.py's reading of a run: batches per minute after the first batch
    (stage seconds, and the wall clock), and held-out accuracy at each evaluation with its time."""
    import json

    bench = load_benchmark("async_rollouts")
    rows = [{"step": 0, "eval/accuracy": 0.25}]
    for batch in (1, 2, 3):  # the first batch waited 5 s for the producer; then 0.5 s of stages each
        stage = 5.0 if batch == 1 else 0.5
        rows.append({"step": batch, "rollout/batch": batch, "perf/collect_s": stage - 0.3, "perf/annotate_s": 0.1,
                     "perf/advantages_s": 0.0, "perf/update_s": 0.2, "perf/elapsed_s": 5.0 + 0.6 * (batch - 1)})
    rows.append({"step": 3, "eval/accuracy": 0.5})
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(row) for row in rows))
    data = bench.read_run(tmp_path)
    rates = bench.throughput(data["train"])
    assert rates["batches_per_min"] == pytest.approx(60 * 2 / 1.0)  # batches 2 and 3: 0.5 s each
    assert rates["batches_per_min_wall"] == pytest.approx(60 * 2 / 1.2)  # 0.6 s apart
    assert bench.accuracy_at(data) == [{"batch": 0, "elapsed_s": 0.0, "accuracy": 0.25},
                                       {"batch": 3, "elapsed_s": pytest.approx(6.2), "accuracy": 0.5}]


def test_gpu_check_parts_run_on_the_cpu_at_tiny_sizes(tmp_path):
    """benchmarks/gpu_check.py (the Python parts of gpu_check.sh) at toy sizes on the CPU: the
    rollout rows (fast eager, fast with the fixed-shape step, which runs eagerly here, and hf) count
    the same tokens and decode greedily alike; a GRPO step of the tiny Qwen2 shape runs its four
    stages under bf16-mixed; a run directory's metrics.jsonl is summarised; the report gathers
    the parts. Speed is the GPU's to measure, never asserted."""
    import json

    bench = load_benchmark("gpu_check")
    assert bench.qwen2_config(bench.QWEN2_5_0_5B).num_key_value_heads == 2  # the config builds, no download
    rollout = bench.main(["rollout", "--model", "tiny", "--rows", "4", "--new-tokens", "5", "--prompt-tokens", "6",
                          "--group-size", "2", "--repeats", "1", "--dtype", "float32",
                          "--json", str(tmp_path / "rollout_tiny.json")])
    assert set(rollout["rows"]) == {"fast_eager", "fast_graphs", "hf"}
    assert {row["tokens"] for row in rollout["rows"].values()} == {4 * 5}  # the EOS is never sampled
    assert rollout["greedy_same_token_share"] == 1.0 and rollout["greedy_logprob_max_gap_before_first_difference"] < 1e-5
    assert rollout["graphs_captured"] is False  # no CUDA here

    step = bench.main(["grpo-step", "--shape", "tiny", "--rows", "4", "--new-tokens", "5", "--prompt-tokens", "6",
                       "--group-size", "2", "--steps", "2", "--precision", "bf16-mixed", "--sampler-dtype", "bfloat16",
                       "--micro-batch-rows", "2", "--cuda-graphs", "true", "--json", str(tmp_path / "grpo_step.json")])
    stages = step["mean_after_first"]
    assert all(stages[f"{s}_s"] >= 0 for s in ("collect", "annotate", "advantages", "update"))
    assert stages["generated_tokens"] == 4 * 5 and isinstance(step["goal_met"], bool)

    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": 0, "eval/accuracy": 0.25}]
    rows += [{"step": s, "perf/collect_s": 1.0 + (s == 1), "perf/annotate_s": 0.0, "perf/advantages_s": 0.0,
              "perf/update_s": 0.5, "perf/tokens_per_s": 100.0 * s} for s in (1, 2, 3)]
    rows.append({"step": 3, "eval/accuracy": 0.5})
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    summary = bench.main(["run-summary", str(run), "--json", str(tmp_path / "run_grpo.json")])
    assert summary["s_per_step"] == pytest.approx(1.5) and summary["first_step_s"] == pytest.approx(2.5)
    assert summary["tokens_per_s"] == pytest.approx(250.0)
    assert (summary["accuracy_first"], summary["accuracy_last"]) == (0.25, 0.5)

    (tmp_path / "broken.json").write_text("{")
    parts = bench.main(["report", str(tmp_path), "--markdown", str(tmp_path / "all.md")])
    assert set(parts) == {"rollout_tiny", "grpo_step", "run_grpo", "broken"} and "error" in parts["broken"]
    table = (tmp_path / "all.md").read_text()
    assert "graphs/eager" in table and "s/step" in table and "goal < 10 s" in table


def test_engines_measures_each_engine_and_dtype_in_a_process_of_its_own(rollout_speed, embedded_hf_model, tmp_path,
                                                                       capsys):
    """--engines through the command line on the embedded model: a worker process per (engine,
    dtype) (one here: each costs an interpreter's start-up), every budget a cell whose tokens are
    the rows' real tokens, and one table with a column per engine measured."""
    out = tmp_path / "engines.json"
    results = rollout_speed.main(["--engines", "--engine-rows", "fast", "--engine-model", str(embedded_hf_model),
                                  "--engine-task", "arithmetic", "--prompts", "2", "--samples", "2", "--budgets", "3",
                                  "5", "--dtypes", "float32", "--threads", "1", "--json", str(out)])
    assert json.loads(out.read_text()) == results
    measured = {(row["engine"], row["dtype"]): row for row in results["engines"]}
    assert set(measured) == {("fast", "float32")}
    for key, row in measured.items():
        assert "error" not in row, (key, row.get("error"))
        assert row["rows"] == 4 and row["peak_rss_gib"] > 0 and row["startup_s"] > 0
        for budget in ("3", "5"):
            cell = row["cells"][budget]
            assert 4 <= cell["tokens"] <= 4 * int(budget), (key, budget, cell)  # each row at least one token
            assert cell["tokens_per_s"] == pytest.approx(cell["tokens"] / cell["seconds"])
    printed = capsys.readouterr().out
    assert "Rollout engines" in printed and "3 tok: tokens/s" in printed and "5 tok: tokens/s" in printed
    assert "vllm" not in printed  # a column per engine measured, none for the others


def test_engines_refuses_an_unknown_engine(rollout_speed):
    with pytest.raises(SystemExit):
        rollout_speed.main(["--engines", "--engine-rows", "fast,sglang"])


def test_head_logprobs_benchmark_times_both_paths_and_finds_them_equal(tmp_path):
    """benchmarks/head_logprobs.py at a tiny size: both paths timed each repeat, the same
    log-probs and gradients (fp32), the result written as JSON."""
    head = load_benchmark("head_logprobs")
    out = tmp_path / "head.json"
    result = head.main(["--tokens", "40", "--vocab", "300", "--hidden", "8", "--repeats", "2", "--fp32",
                        "--json", str(out)])
    assert json.loads(out.read_text())["settings"]["tokens"] == 40
    for path in head.PATHS:
        assert len(result["seconds"][path]["forward"]) == 2 and result["total_s"][path] > 0
    assert max(result["max_abs_difference"].values()) < 1e-4
    assert result["matmul_floor_s"] > 0
