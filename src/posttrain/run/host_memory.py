"""Freed host memory goes back to the system at once (glibc's malloc, CPU runs).

By default glibc serves a large allocation from its heap once a free of that size has raised
its dynamic mmap threshold (up to 32 MiB), and a freed heap chunk below the heap's top stays
resident. A training step frees and allocates hundreds of activation buffers of a few to tens
of MiB each, so the process keeps the freed ones and its peak RSS is their sum, not the live
memory. Measured on SmolLM2-135M's forward + backward with checkpointing (16 rows x 512 response
tokens, benchmarks/memory_vs_length.py --one new+ckpt 512 --layers 30): 1743 MB above the model
by default, 1213 MB with a fixed 128 KiB threshold. A fixed threshold serves every allocation of
at least that size by mmap, returned by munmap when freed; the price is a page fault per page on
each such allocation: 4 layers at 256 tokens, one thread, three A/B pairs took 46.5-50.1 s by
default and 53.1-56.2 s with it (+12%), for 540 MB against 754-868 MB.

That price is the page faults, one per 4 KiB page, and transparent huge pages remove it: with
PyTorch's allocator asking for them (``THP_MEM_ALLOC_ENABLE=1``, which `posttrain/__init__.py`
sets before torch loads where the kernel offers them), a buffer of 2 MiB or more faults in 2 MiB
at a time. Smaller buffers still fault page by page, so the automatic threshold is 2 MiB, where
the huge pages start: on the embedded task's GRPO step (activations of a few hundred KiB) a 128
KiB threshold costs 35-50% of the time (115-127 ms against 85 ms by default), 2048 KiB nothing
(81 ms). 8 of SmolLM2's layers, 16 rows x 512 tokens, checkpointed, one thread, fresh processes:
huge pages alone 1389-1508 MB above the start at 48-51 s a step; with the threshold at 2048 KiB
836 MB at 51-53 s; at 128 KiB 819 MB (glibc's default without huge pages: 1584 MB). Hence the
default was 2048 where PyTorch's allocator has huge pages, glibc's default where it has not
(the time cost would be back).

That time cost is not gone everywhere. On the 2-core Firecracker VMs of 2026-12-02, memory the
process writes for the first time gets slower to write as the process grows, huge pages or not
(`benchmarks/first_touch.py`: 1.8-5 GB/s for the first 160 MB of fresh 16 MB buffers, 0.3-0.4
GB/s past 3 GB, against 7.5 GB/s to rewrite them), and a training forward without checkpointing
writes every activation it saves into such memory at each step: on SmolLM2's bf16 GRPO step at
128 tokens (16 rows, one thread) its forward took 8.1 s with the threshold and 4.7 s without,
the step 28-32 s against 26 s, for a peak of 5693 against 6075 MB. So ``auto`` is now 2048 only
where the run also checkpoints its policy (`model.gradient_checkpointing`, or the FSDP
strategy's): there memory is what the run has chosen to save, few activations are kept, and
without the threshold the checkpointed update's peak at 512 tokens doubled (3357 MB, 1.64x the
floor, against 4537 MB, 2.21x). Without checkpointing the process keeps what it frees, and a step
reuses it."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)


AUTO_THRESHOLD_KIB = 2048  # PyTorch asks for huge pages from 2 MiB (c10 alloc_cpu)


def threshold_kib(setting: int | str | None, checkpointed: bool) -> int | None:
    """The threshold ``host_mmap_threshold_kib`` asks for: ``auto`` is `AUTO_THRESHOLD_KIB` where
    the run checkpoints its policy (`checkpointed`) and PyTorch's allocator has huge pages
    (``THP_MEM_ALLOC_ENABLE=1``, set by `posttrain/__init__.py` before torch loaded, or by the
    user), else None (the module docstring says why)."""
    if setting != "auto":
        return setting
    return AUTO_THRESHOLD_KIB if checkpointed and os.environ.get("THP_MEM_ALLOC_ENABLE") == "1" else None


def return_freed_memory(threshold_kib: int | None) -> bool:
    """Serve allocations of at least `threshold_kib` KiB by mmap from now on (glibc `mallopt`);
    None leaves the allocator as it is. True when the setting took effect; False without glibc
    (macOS, musl), where it is skipped with a debug log line."""
    if threshold_kib is None:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        log.debug("host_mmap_threshold_kib: not glibc, left as it is")
        return False
    return mallopt(M_MMAP_THRESHOLD, int(threshold_kib) * 1024) == 1
