"""benchmarks/rollout_speed.py runs and counts tokens consistently.

Behaviour only: speed is measured by the benchmark itself, never asserted in tests.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "rollout_speed.py"


@pytest.fixture(scope="module")
def rollout_speed():
    # benchmarks/ is a folder of scripts, not a package: load the file by path
    spec = importlib.util.spec_from_file_location("rollout_speed", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
