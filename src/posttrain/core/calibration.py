"""Calibration: does a model's confidence in its answers match how often they are right?

Expected calibration error (ECE; Naeini et al. 2015, Guo et al. 2017) over ``num_bins``
equal-width confidence bins of [0, 1]: bin b holds the answers with confidence in
[b/M, (b+1)/M) (the last bin also holds confidence 1), and

    ECE = sum_b (n_b / N) |acc_b - conf_b| = (1/N) sum_b |sum_{i in b} correct_i - sum_{i in b} conf_i|

with n_b answers in bin b, acc_b their share correct and conf_b their mean confidence. A
perfectly calibrated model (of its answers given confidence p, a share p right) has ECE 0; an
over-confident one has conf_b > acc_b.

Computed in two steps so that data-parallel ranks can add their parts: ``calibration_bins``
gives per-bin sums (count, confidence, correct) that add over ranks and batches, and
``calibration_error`` reads the ECE off the summed bins; ``expected_calibration_error`` is the
two in one. ``reliability`` turns the bins into the points of a reliability diagram.
"""

from __future__ import annotations

import torch

from .checks import check_finite

# rows of calibration_bins' [3, num_bins] tensor
COUNT, CONFIDENCE, CORRECT = 0, 1, 2


def calibration_bins(confidence, correct, num_bins: int = 10) -> torch.Tensor:
    """[3, num_bins] float64 sums per equal-width confidence bin: row COUNT the number of
    answers, row CONFIDENCE the sum of their confidences, row CORRECT the number right.

    ``confidence`` [N] in [0, 1]; ``correct`` [N] 1/0 (or any score in [0, 1]: the bin's
    accuracy is then its mean score). Bin b is [b/M, (b+1)/M); confidence 1 is in bin M - 1.
    N = 0 gives all zeros (a rank with no answers adds nothing)."""
    if not isinstance(num_bins, int) or num_bins < 1:
        raise ValueError(f"num_bins must be an integer >= 1, got {num_bins!r}")
    confidence = torch.as_tensor(confidence, dtype=torch.float64).detach().flatten()
    correct = torch.as_tensor(correct, dtype=torch.float64, device=confidence.device).detach().flatten()
    if confidence.shape != correct.shape:
        raise ValueError(f"confidence has {confidence.numel()} values but correct has {correct.numel()}")
    check_finite("confidence", confidence)
    check_finite("correct", correct)
    if bool(((confidence < 0) | (confidence > 1)).any()):
        raise ValueError(f"confidence must lie in [0, 1], got values from {confidence.min().item()} "
                         f"to {confidence.max().item()}")
    index = (confidence * num_bins).floor().long().clamp(max=num_bins - 1)
    bins = torch.zeros(3, num_bins, dtype=torch.float64, device=confidence.device)
    bins[COUNT].index_add_(0, index, torch.ones_like(confidence))
    bins[CONFIDENCE].index_add_(0, index, confidence)
    bins[CORRECT].index_add_(0, index, correct)
    return bins


def calibration_error(bins: torch.Tensor) -> torch.Tensor:
    """The ECE of summed ``calibration_bins``: (1/N) sum_b |correct_b - confidence_b| (sums of
    bin b, N the number of answers); 0 when there are none."""
    if bins.dim() != 2 or bins.shape[0] != 3:
        raise ValueError(f"bins must be a [3, num_bins] tensor from calibration_bins, got shape {tuple(bins.shape)}")
    total = bins[COUNT].sum()
    if total <= 0:
        return torch.zeros((), dtype=bins.dtype, device=bins.device)
    return (bins[CORRECT] - bins[CONFIDENCE]).abs().sum() / total


def expected_calibration_error(confidence, correct, num_bins: int = 10) -> torch.Tensor:
    """ECE of answers with ``confidence`` [N] in [0, 1] and ``correct`` [N] over ``num_bins``
    equal-width bins (float64 scalar)."""
    return calibration_error(calibration_bins(confidence, correct, num_bins))


def reliability(bins: torch.Tensor) -> dict[str, torch.Tensor]:
    """A reliability diagram's values per bin [num_bins]: ``share`` (n_b / N), ``confidence``
    (mean confidence of the bin) and ``accuracy`` (share correct); both 0 in an empty bin,
    which ``share`` 0 marks."""
    total = bins[COUNT].sum().clamp(min=1.0)
    count = bins[COUNT].clamp(min=1.0)  # an empty bin's sums are 0: 0 / 1
    return {"share": bins[COUNT] / total, "confidence": bins[CONFIDENCE] / count, "accuracy": bins[CORRECT] / count}
