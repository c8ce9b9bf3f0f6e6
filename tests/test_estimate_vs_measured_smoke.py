"""benchmarks/estimate_vs_measured.py on a small embedded run: it profiles the middle step,
measures each stage's live tensor bytes and sets them beside posttrain-estimate's figures.

Behaviour only: the errors it reports are the benchmark's to measure (docs/estimate.md)."""

from __future__ import annotations

import json

from conftest import load_benchmark


def test_a_short_run_is_measured_stage_by_stage_and_compared(tmp_path, capsys):
    from posttrain.algorithms import base, online
    from posttrain.algorithms.online import module as online_module

    benchmark = load_benchmark("estimate_vs_measured")
    originals = (online.OnlineRLModule.training_step, online.OnlineRLModule.update, online_module.stop_token_ids,
                 base.stop_token_ids)
    out = tmp_path / "tiny.json"
    result = benchmark.main(["--case", "tiny", "--steps", "3", "--threads", "1", "--json", str(out),
                             "algorithm.prompts_per_step=2", "algorithm.group_size=2", "data.max_response_tokens=8",
                             f"paths.cache_dir={tmp_path / 'cache'}"])
    assert json.loads(out.read_text())["case"] == "tiny"
    # what the run patched is put back: later tests in this process see the real module
    assert (online.OnlineRLModule.training_step, online.OnlineRLModule.update, online_module.stop_token_ids,
            base.stop_token_ids) == originals
    assert "step peak" in capsys.readouterr().out
    # every response ran to the budget: the estimate is taken at the widths the run had
    assert result["widths"]["response_tokens"] == 8 and result["widths"]["rows"] == 4
    (step, peaks), = result["measured_bytes"].items()  # the middle step of three
    assert step == "2"
    baseline = result["baselines"]["2"]
    assert peaks["update"] > baseline  # the backward's activations and gradients come on top
    assert peaks["step"] == max(peaks[s] for s in ("collect", "annotate", "update"))
    for stage in ("generate", "annotate", "update", "step peak"):
        row = result["memory"][stage]
        assert row["predicted_mib"] > 0 and row["measured_mib"] > 0
        assert abs(row["error_pct"] - 100 * (row["predicted_mib"] / row["measured_mib"] - 1)) < 1  # MiB rounded
    assert len(result["seconds"]["measured_step_s"]) == 1 and result["seconds"]["lower_bound_step_s"] > 0
