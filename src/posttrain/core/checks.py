"""Input validation and registry lookup shared by every ``core`` module.

Bad numbers must fail loudly and name the argument: a NaN reward that silently becomes a
NaN loss costs a whole run, a clear ``ValueError`` costs a minute.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

_FINITE_CHECKS = True


def set_finite_checks(enabled: bool) -> None:
    """Turn the NaN/inf checks on or off (on by default).

    Each check reads one boolean back from the device; on GPU that is a host sync, which a
    throughput benchmark may want to switch off once a recipe is known to be clean.
    """
    global _FINITE_CHECKS
    _FINITE_CHECKS = bool(enabled)


def finite_checks_enabled() -> bool:
    return _FINITE_CHECKS


def check_finite(name: str, x: torch.Tensor, mask: torch.Tensor | None = None) -> None:
    """Raise ``ValueError`` naming ``name`` if ``x`` holds NaN/inf where ``mask`` is set.

    Padded positions (``mask == 0``) are not inspected: padding may legitimately hold
    garbage, and every core function masks it with ``torch.where`` (never ``x * mask``,
    since ``inf * 0`` is NaN).
    """
    if not _FINITE_CHECKS or not torch.is_tensor(x) or not x.is_floating_point():
        return
    bad = ~torch.isfinite(x.detach())
    if mask is not None:
        bad = bad & (mask != 0)
    if bool(bad.any()):
        n = int(bad.sum())
        first = tuple(int(i) for i in bad.nonzero()[0].tolist())
        raise ValueError(
            f"{name} contains {n} non-finite value(s) (NaN or inf) at valid positions; "
            f"first at index {first}"
        )


def check_shape(name: str, x: torch.Tensor, shape: torch.Size | tuple, ref_name: str) -> None:
    """Raise ``ValueError`` if ``x.shape`` differs from ``shape`` (the shape of ``ref_name``)."""
    if tuple(x.shape) != tuple(shape):
        raise ValueError(
            f"{name} has shape {tuple(x.shape)} but {ref_name} has shape {tuple(shape)}"
        )


def valid_mask(mask: torch.Tensor) -> torch.Tensor:
    """Boolean view of a bool/float/int mask: True where the entry counts."""
    return mask if mask.dtype == torch.bool else mask != 0


def lookup(registry: Mapping[str, Callable[..., Any]], name: str, family: str) -> Callable[..., Any]:
    """``registry[name]`` or a ``ValueError`` that names the family and lists valid names."""
    try:
        return registry[name]
    except (KeyError, TypeError):
        valid = ", ".join(sorted(registry))
        raise ValueError(f"unknown {family} {name!r}; valid names: {valid}") from None
