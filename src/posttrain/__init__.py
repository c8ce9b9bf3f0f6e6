"""posttrain: LLM post-training with reinforcement learning (Lightning + Hydra)."""

import os
import sys


def _ask_torch_for_huge_pages() -> None:
    """PyTorch's CPU allocator asks the kernel for transparent huge pages (madvise) on buffers of
    2 MiB and more when ``THP_MEM_ALLOC_ENABLE=1`` is set before its first allocation, i.e. before
    ``import torch``. posttrain sets it (a user's own value wins) where the kernel offers huge
    pages and torch has not loaded yet: it is what makes returning freed host memory at once free
    of cost (run/host_memory.py reads the variable: set means the allocator has them)."""
    if "torch" not in sys.modules and _kernel_offers_huge_pages():
        os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def _kernel_offers_huge_pages() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:  # not Linux, or no THP
        return False


_ask_torch_for_huge_pages()
