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
