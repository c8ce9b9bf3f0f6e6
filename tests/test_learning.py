"""Learning is shown, not assumed: the headline preset end to end (slow: about 3 minutes).

    python -m pytest -m slow tests/test_learning.py
"""

import pytest

from posttrain.train import run


@pytest.mark.slow
def test_headline_grpo_raises_heldout_accuracy_by_20_points(make_config, tmp_path):
    cfg = make_config("experiment=grpo_tiny", "logger=none", "callbacks.progress_bar=none",
                      f"paths.cache_dir={tmp_path}/cache")
    summary = run(cfg)
    assert summary["eval/accuracy"] >= summary["eval/accuracy_start"] + 0.20, summary
