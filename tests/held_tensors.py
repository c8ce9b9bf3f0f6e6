"""What a forward leaves held: a dispatch mode that remembers every op's output (and counts the
matmuls run), so that once the forward returns, the storages still alive are what autograd and
checkpointing keep for the backward."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)


class OpOutputs(TorchDispatchMode):
    """Counts the matmuls run (`matmuls`) and remembers every op's output, to sum what is still held later."""

    def __init__(self):
        super().__init__()
        self.matmuls, self.outputs = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.matmuls += func in MATMULS
        self.outputs += [weakref.ref(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out

    def held_bytes(self, skip=(), excluded_storages=frozenset()) -> int:
        """Bytes of the storages of the outputs still alive (each storage once), the tensors in
        `skip` and the storages whose data pointers are in `excluded_storages` left out."""
        alive = [t for t in (ref() for ref in self.outputs) if t is not None and not any(t is s for s in skip)]
        held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in alive}
        return sum(n for ptr, n in held.items() if ptr not in excluded_storages)
