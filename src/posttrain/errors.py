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


class CheckpointError(PosttrainError):
    """A checkpoint or model directory that is missing or unreadable."""
