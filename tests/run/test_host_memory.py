"""run/host_memory.py: with the threshold set, freed activation-sized buffers leave the
process's resident memory; with glibc's default they stay (the peak RSS they inflate)."""

from __future__ import annotations

import sys

import pytest
from forked_cli import run_command

# Ten 20 MB buffers, each followed by a small allocation that pins the heap's top, then freed:
# the pattern of a forward's activations between longer-lived tensors. The first 20 MB free
# raises glibc's dynamic mmap threshold, so by default the ten come from the heap and stay.
FRAGMENTING = """
import sys, torch
from posttrain.run.host_memory import return_freed_memory
def rss_mb():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) / 1024
took = return_freed_memory(None if sys.argv[1] == "null" else int(sys.argv[1]))
first = torch.ones(5_000_000); del first
before, buffers, pins = rss_mb(), [], []
for _ in range(10):
    buffers.append(torch.ones(5_000_000)); pins.append(torch.ones(20_000))
del buffers
print(took, round(rss_mb() - before))
"""


def retained_mb(threshold: str) -> tuple[str, int]:
    finished = run_command([sys.executable, "-c", FRAGMENTING, threshold], timeout=120)
    assert finished.returncode == 0, finished.stderr[-2000:]
    took, retained = finished.stdout.split()[-2:]
    return took, int(retained)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator and /proc")
def test_freed_buffers_leave_resident_memory_only_with_the_threshold():
    assert retained_mb("null") == ("False", pytest.approx(190, abs=30))  # glibc's default keeps them
    took, retained = retained_mb("128")
    assert took == "True" and retained < 20


def test_a_cpu_run_sets_the_threshold_it_is_given_before_anything_loads(make_config, monkeypatch):
    import lightning

    import posttrain.run.host_memory as host_memory
    from posttrain.train import run

    given = []
    monkeypatch.setattr(host_memory, "return_freed_memory", lambda kib: given.append(kib) or True)

    def stop(*args, **kwargs):
        raise RuntimeError("stopped after the set-up")

    monkeypatch.setattr(lightning, "seed_everything", stop)
    for threshold in ("256", "null"):
        with pytest.raises(RuntimeError, match="stopped after the set-up"):
            run(make_config(f"host_mmap_threshold_kib={threshold}"))
    assert given == [256, None]
