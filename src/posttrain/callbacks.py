"""Lightning callbacks of our own."""

from __future__ import annotations

from lightning.pytorch.callbacks import Callback


class StopAtStep(Callback):
    """Stop as if preempted once `step` optimiser steps are done. The LR schedule still
    spans trainer.max_steps, so resuming from the last checkpoint continues the same run."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


class StopAtAccuracy(Callback):
    """Stop once a held-out evaluation reaches `threshold` greedy accuracy: the SFT warm
    start ends at a chosen point of its learning curve, whatever the seed's pace."""

    def __init__(self, threshold: float):
        self.threshold = threshold

    def on_validation_end(self, trainer, pl_module) -> None:
        accuracy = trainer.callback_metrics.get("eval/accuracy")
        if not trainer.sanity_checking and accuracy is not None and float(accuracy) >= self.threshold:
            trainer.should_stop = True
