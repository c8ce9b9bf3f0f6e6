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
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")
    for checkpointing in ("true", "selective", "false"):  # auto: returned at once only for a checkpointed policy
        with pytest.raises(RuntimeError, match="stopped after the set-up"):
            run(make_config("host_mmap_threshold_kib=auto", f"model.gradient_checkpointing={checkpointing}"))
    assert given == [256, None, 2048, 2048, None]


def test_auto_returns_freed_memory_only_for_a_checkpointed_policy_where_torch_has_huge_pages(monkeypatch):
    from posttrain.run.host_memory import AUTO_THRESHOLD_KIB, threshold_kib

    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")
    assert threshold_kib("auto", checkpointed=True) == AUTO_THRESHOLD_KIB == 2048  # where PyTorch's huge pages start
    assert threshold_kib("auto", checkpointed=False) is None  # a step reuses what it freed
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE")  # the page faults would cost ~12% of the time
    assert threshold_kib("auto", checkpointed=True) is None
    for checkpointed in (True, False):  # explicit settings are kept
        assert threshold_kib(256, checkpointed) == 256 and threshold_kib(None, checkpointed) is None


HUGE_PAGES = """
import os, sys
if sys.argv[1] == "torch first":
    import torch
import posttrain
from posttrain.run.host_memory import threshold_kib
print(threshold_kib("auto", checkpointed=True), os.environ.get("THP_MEM_ALLOC_ENABLE"))
"""


def _huge_pages(order: str, **env) -> list[str]:
    import os

    finished = run_command([sys.executable, "-c", HUGE_PAGES, order], timeout=120,
                           env={k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"} | env)
    assert finished.returncode == 0, finished.stderr[-2000:]
    return finished.stdout.split()[-2:]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's transparent huge pages")
def test_posttrain_asks_torch_for_huge_pages_before_torch_loads_and_a_users_choice_wins():
    from posttrain import _kernel_offers_huge_pages

    offered = _kernel_offers_huge_pages()
    assert _huge_pages("posttrain first") == (["2048", "1"] if offered else ["None", "None"])
    assert _huge_pages("torch first") == ["None", "None"]  # too late for torch's allocator: not claimed
    assert _huge_pages("posttrain first", THP_MEM_ALLOC_ENABLE="0") == ["None", "0"]
