"""Expected calibration error (core/calibration.py) against values computed by hand."""

import pytest
import torch

from posttrain.core.calibration import (
    calibration_bins,
    calibration_error,
    expected_calibration_error,
    reliability,
)

CONFIDENCE = [0.05, 0.15, 0.12, 0.95, 1.0, 0.55]
CORRECT = [0.0, 1.0, 0.0, 1.0, 1.0, 0.0]


def test_ece_by_hand():
    # 10 bins: 0.05 -> bin 0; 0.15, 0.12 -> bin 1; 0.55 -> bin 5; 0.95, 1.0 -> bin 9 (1.0 in the last bin)
    # |correct - confidence| summed per bin: bin 0 |0 - 0.05| = 0.05; bin 1 |1 - 0.27| = 0.73;
    # bin 5 |0 - 0.55| = 0.55; bin 9 |2 - 1.95| = 0.05; total 1.38 over 6 answers
    assert expected_calibration_error(CONFIDENCE, CORRECT).item() == pytest.approx(1.38 / 6)
    bins = calibration_bins(CONFIDENCE, CORRECT)
    assert bins.shape == (3, 10) and bins.dtype == torch.float64
    assert bins[0].tolist() == [1, 2, 0, 0, 0, 1, 0, 0, 0, 2]
    assert bins[1].tolist() == pytest.approx([0.05, 0.27, 0, 0, 0, 0.55, 0, 0, 0, 1.95])
    assert bins[2].tolist() == [0, 1, 0, 0, 0, 0, 0, 0, 0, 2]
    # one bin: |accuracy - mean confidence| = |3/6 - 2.82/6|
    assert expected_calibration_error(CONFIDENCE, CORRECT, num_bins=1).item() == pytest.approx(0.18 / 6)


def test_bin_edges_are_left_closed():
    # 4 bins [0, .25), [.25, .5), [.5, .75), [.75, 1]: exact binary fractions land on the edges
    bins = calibration_bins([0.0, 0.25, 0.5, 0.75, 1.0, 0.2499], [1, 1, 1, 1, 1, 1], num_bins=4)
    assert bins[0].tolist() == [2, 1, 1, 2]


def test_calibrated_and_overconfident_answers():
    # of 4 answers at confidence 0.75, 3 right: calibrated; all wrong: ECE = the confidence
    assert expected_calibration_error([0.75] * 4, [1, 1, 1, 0]).item() == pytest.approx(0.0)
    assert expected_calibration_error([0.75] * 4, [0, 0, 0, 0]).item() == pytest.approx(0.75)
    # over-confident and under-confident bins do not cancel: |1 - 0.1| and |0 - 0.9|, each for 1 of 2
    assert expected_calibration_error([0.1, 0.9], [1, 0]).item() == pytest.approx(0.9)


def test_bins_add_over_ranks():
    """Each rank's bins summed give the bins of all answers: the ECE of the whole."""
    whole = calibration_bins(CONFIDENCE, CORRECT)
    parts = calibration_bins(CONFIDENCE[:2], CORRECT[:2]) + calibration_bins(CONFIDENCE[2:], CORRECT[2:])
    torch.testing.assert_close(parts, whole)
    empty = calibration_bins([], [])
    assert empty.abs().sum() == 0 and calibration_error(empty).item() == 0.0
    assert calibration_error(whole + empty).item() == pytest.approx(1.38 / 6)


def test_reliability_points_by_hand():
    points = reliability(calibration_bins(CONFIDENCE, CORRECT))
    assert points["share"].tolist() == pytest.approx([1 / 6, 2 / 6, 0, 0, 0, 1 / 6, 0, 0, 0, 2 / 6])
    assert points["confidence"].tolist() == pytest.approx([0.05, 0.135, 0, 0, 0, 0.55, 0, 0, 0, 0.975])
    assert points["accuracy"].tolist() == pytest.approx([0, 0.5, 0, 0, 0, 0, 0, 0, 0, 1])


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match=r"confidence must lie in \[0, 1\]"):
        calibration_bins([0.5, 1.2], [1, 0])
    with pytest.raises(ValueError, match="confidence contains"):
        calibration_bins([float("nan")], [1])
    with pytest.raises(ValueError, match="confidence has 2 values but correct has 1"):
        calibration_bins([0.5, 0.5], [1])
    with pytest.raises(ValueError, match="num_bins"):
        calibration_bins([0.5], [1], num_bins=0)
    with pytest.raises(ValueError, match=r"\[3, num_bins\]"):
        calibration_error(torch.zeros(2, 10))
