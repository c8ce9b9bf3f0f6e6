"""benchmarks/eval_curves.py: held-out curves of finished runs, aligned on shared steps, with their mean."""

from __future__ import annotations

import json

import pytest

from conftest import load_benchmark


def fake_run(directory, seed: int, accuracies: dict[int, float], train_seconds: float):
    directory.mkdir()
    (directory / "config.yaml").write_text(f"seed: {seed}\n")
    lines = [{"step": s, "eval/accuracy": a} for s, a in accuracies.items()]
    lines.insert(1, {"step": 1, "policy/loss": 0.5})  # a training record: not a point of the curve
    (directory / "metrics.jsonl").write_text("\n".join(json.dumps(line) for line in lines))
    (directory / "summary.json").write_text(json.dumps({"train_seconds": train_seconds}))
    return directory


def test_the_table_aligns_runs_on_their_shared_steps_and_averages_them(tmp_path, capsys):
    curves = load_benchmark("eval_curves")
    one = fake_run(tmp_path / "a", 0, {0: 0.25, 5: 0.5, 10: 0.75}, 100.0)
    two = fake_run(tmp_path / "b", 1, {0: 0.25, 10: 0.25}, 90.0)  # evaluated at 0 and 10 only
    curves.main([str(one), str(two), "--markdown"])
    rows = capsys.readouterr().out.strip().splitlines()
    assert rows[0] == "| step | seed 0 | seed 1 | mean |"
    assert rows[2:] == ["| 0 | 25.0 | 25.0 | 25.0 |", "| 10 | 75.0 | 25.0 | 50.0 |", "| train s | 100 | 90 |  |"]


def test_a_run_without_the_metric_is_named(tmp_path):
    curves = load_benchmark("eval_curves")
    run = fake_run(tmp_path / "a", 0, {0: 0.5}, 1.0)
    with pytest.raises(SystemExit, match="no 'eval/pass@1'"):
        curves.main([str(run), "--metric", "eval/pass@1"])
