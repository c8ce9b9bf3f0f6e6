"""Activation checkpointing of the decoder layers: what the backward keeps of each layer, and
what it computes again (`model.gradient_checkpointing`).

- ``false``: every activation is kept.
- ``true``: each layer keeps its input only; the backward runs the layer again first (about
  one more forward of matmuls).
- ``"selective"``: each layer keeps its input and the outputs of its matmuls and of its
  attention kernel; the backward recomputes only the cheap ops between them (norms, RoPE, the
  SiLU product, dtype casts, the grouped forward's layout copies), so no matmul runs twice. On
  SmolLM2 a layer keeps about 6,300 elements per token (`core/cost.py:selective_layer_bytes`)
  against its input's 576 with ``true`` and about 11,900 without checkpointing. Whether that
  is faster than ``true`` depends on the device: on a 2-core CPU, where writing the kept outputs
  to fresh memory costs more than the matmuls saved, it is 13% slower (docs/results.md,
  "Selective checkpointing").

The same choice reaches both training forwards: Hugging Face's own layers take the
checkpoint function given to `activation_checkpointing_enable`, and the grouped forward
(`models/grouped_forward.py`) calls that same function (`layer_checkpoint`). Both use
non-reentrant checkpointing, the kind that composes with FSDP2's hooks, and the
recomputation stops as soon as the last kept tensor the backward needs is back (PyTorch's
early stop: a layer's last matmul, whose output only feeds the residual, is not recomputed).
The recomputed ops are the forward's own, so the log-probs are bitwise the unchecked ones and
the gradients equal them to float rounding (tested, fp32).
"""
from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

MODES = (False, True, "selective")

# the ops whose outputs "selective" keeps: every matmul and every attention kernel a decoder
# layer may run (eager ops, as the dispatcher sees them below autograd)
KEPT_OPS = frozenset(getattr(torch.ops.aten, name).default for name in (
    "mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention") if hasattr(torch.ops.aten, name))


def _keep_matmul_outputs(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_kwargs(mode) -> dict:
    """`torch.utils.checkpoint.checkpoint`'s keyword arguments for a checkpointing mode."""
    if mode not in MODES or mode is False:
        raise ValueError(f"no checkpointing for mode {mode!r}; expected one of {MODES[1:]}")
    kwargs = {"use_reentrant": False}  # the reentrant variant does not compose with FSDP2's hooks
    if mode == "selective":
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _keep_matmul_outputs)
    return kwargs


def enable_activation_checkpointing(lm: nn.Module, mode=True) -> None:
    """Hugging Face checkpointing of every decoder layer of `lm`, as `mode` says (true or "selective")."""
    kwargs = checkpoint_kwargs(mode)
    if hasattr(lm, "activation_checkpointing_enable"):  # transformers >= 5.x's name
        lm.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def checkpointing_on(hf_model: nn.Module) -> bool:
    """Whether the Hugging Face model has activation (gradient) checkpointing on."""
    on = getattr(hf_model, "is_activation_checkpointing", None)  # transformers >= 5.x's name
    return bool(on if on is not None else getattr(hf_model, "is_gradient_checkpointing", False))


def layer_checkpoint(block: nn.Module):
    """The function that checkpoints `block` (a decoder layer), called as
    ``checkpoint(fn, *args)``: the one Hugging Face was given, so the grouped forward keeps what
    the model's own layers keep; plain non-reentrant checkpointing where the layer has none."""
    given = getattr(block, "_gradient_checkpointing_func", None)
    return given if given is not None else functools.partial(checkpoint, use_reentrant=False)
