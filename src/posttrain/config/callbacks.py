"""What `callbacks.*` accepts (conf/callbacks/: checkpoints, the progress bar, early stops)."""

from __future__ import annotations

from posttrain.config.spec import Spec, choice, integer, number, optional

SPECS: dict[str, Spec] = {
    "callbacks.checkpoint.every_n_train_steps": integer(1),
    "callbacks.checkpoint.save_top_k": integer(-1).about("-1: keep every checkpoint"),
    "callbacks.progress_bar": choice("rich", "none"),
    "callbacks.stop_at_step": optional(integer(1)),
    "callbacks.stop_at_accuracy": optional(number(0, 1, low_open=True)),
}
