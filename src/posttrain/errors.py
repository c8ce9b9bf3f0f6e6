"""User-facing errors: each names the culprit (config key, file, sample) in one paragraph.

`posttrain` prints these without a traceback and exits non-zero; anything else is a bug
and keeps its traceback.
"""


class PosttrainError(Exception):
    """Base class of errors caused by the user's input, not by a bug."""


class ConfigError(PosttrainError):
    """A config key, group option or combination of choices that cannot work."""


class DataError(PosttrainError):
    """A data file or sample that is malformed."""


class RewardError(PosttrainError):
    """A reward function raised or returned a non-finite value."""


class MismatchError(PosttrainError):
    """The sampler and the trainer disagreed beyond `rollout.mismatch_budget` (action: stop)."""


class CheckpointError(PosttrainError):
    """A checkpoint or model directory that is missing or unreadable."""


class PreemptedError(PosttrainError):
    """The run was stopped by a signal (SIGTERM, SIGUSR1, SIGUSR2) after writing a checkpoint;
    `exit_code` is what the process exits with (never 0: the run did not finish)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code
