"""How fast this machine writes memory the process has never touched, against memory it has.

A training forward keeps its activations for the backward, and with posttrain's default
`host_mmap_threshold_kib: auto` every buffer of 2 MiB or more is a fresh mapping, so each step
writes them into pages the kernel must fault in (and zero) first. This allocates `--buffers`
tensors of `--mb` MB one after another, fills each once (first touch), then fills them all again
(rewrite), and prints the rates; run it once with ``THP_MEM_ALLOC_ENABLE=1`` (PyTorch asks for
huge pages, posttrain's default where the kernel offers them) and once with ``=0``:

    THP_MEM_ALLOC_ENABLE=1 python benchmarks/first_touch.py
    THP_MEM_ALLOC_ENABLE=0 python benchmarks/first_touch.py
"""

from __future__ import annotations

import argparse
import ctypes
import os
import time

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h), as run/host_memory.py sets it


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--buffers", type=int, default=200)
    parser.add_argument("--mb", type=int, default=16)
    parser.add_argument("--mmap-threshold-kib", type=int, default=2048, help="0: glibc's default")
    args = parser.parse_args(argv)
    if args.mmap_threshold_kib:
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, args.mmap_threshold_kib * 1024)
    import torch  # after the environment and the allocator settings, as posttrain loads it

    torch.set_num_threads(1)
    elements = args.mb * 1024 * 1024 // 2
    buffers, fills = [], []
    for _ in range(args.buffers):
        buffer = torch.empty(elements, dtype=torch.bfloat16)
        started = time.perf_counter()
        buffer.fill_(1.0)
        fills.append(time.perf_counter() - started)
        buffers.append(buffer)
    started = time.perf_counter()
    for buffer in buffers:
        buffer.fill_(2.0)
    rewrite = time.perf_counter() - started
    tenth = max(1, args.buffers // 10)
    gb = args.mb / 1024

    def rate(seconds: list[float]) -> str:
        return f"{len(seconds) * gb / sum(seconds):.2f} GB/s"

    print(f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset')}, {args.buffers} x {args.mb} MB: "
          f"first touch {rate(fills)} (first {tenth} buffers {rate(fills[:tenth])}, last {tenth} "
          f"{rate(fills[-tenth:])}); rewrite {args.buffers * gb / rewrite:.2f} GB/s")


if __name__ == "__main__":
    main()
