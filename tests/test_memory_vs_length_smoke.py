"""benchmarks/memory_vs_length.py: its tables read the rows right, an out-of-memory row included.

Behaviour only: memory and speed are measured by the benchmark itself, never asserted in tests.
"""

from __future__ import annotations

import pytest
from conftest import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("memory_vs_length")


def rows(peaks):
    return [{"method": m, "length": n, "layers": 4, "peak_mb": mb, "seconds": None if mb is None else mb / 100}
            for (m, n), mb in peaks.items()]


def test_table_and_slopes_with_an_out_of_memory_row(bench):
    peaks = {("old", 128): 300.0, ("new", 128): 100.0, ("hf", 128): 200.0,
             ("old", 256): None, ("new", 256): 164.0, ("hf", 256): 328.0}
    table = bench.table(rows(peaks), [128, 256]).splitlines()
    assert table[2] == "| 128 | 300 | 100 | 200 | 0.33 | 0.50 | 3.0 | 1.0 | 2.0 | 0.33 | 0.50 |"
    assert table[3].startswith("| 256 | OOM | 164 | 328 | - | 0.50 | OOM |")
    slopes = bench.slopes(rows(peaks), [128, 256]).splitlines()
    assert slopes[2:] == ["| old | - |", "| new | 0.50 |", "| hf | 1.00 |"]


def test_the_old_forward_is_read_from_git(bench):
    old = bench.load_old_grouped_forward("HEAD")
    assert callable(old.grouped_logits)
