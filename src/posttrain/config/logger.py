"""What `logger.*` accepts (conf/logger/: W&B, CSV or none, and the user's own loggers beside it)."""

from __future__ import annotations

from posttrain.config.callbacks import user_components
from posttrain.config.spec import Spec, choice, list_of, optional, text

SPECS: dict[str, Spec] = {
    "logger.backend": choice("wandb", "csv", "none"),
    "logger.project": text(),
    "logger.entity": optional(text()),
    "logger.mode": choice("auto", "online", "offline", "disabled"),
    "logger.tags": list_of(text()),
    "logger.group": optional(text()).about("the W&B group; null: the task name, or the sweep's name and time"),
    "logger.job_type": text().about("the W&B job type"),
    "logger.extra": user_components("a lightning.pytorch.loggers.Logger subclass, beside logger.backend"),
}
