"""Command-line rewriting before Hydra parses it: `resume=<run dir>` becomes the run's own
command line, and a sweep over a group may set keys only its options have."""

from __future__ import annotations

from pathlib import Path

from posttrain.errors import CheckpointError, ConfigError


def resume_arguments(arguments: list[str]) -> list[str]:
    """`posttrain resume=<run dir> [overrides]` -> that run's own command line: its saved
    overrides (.hydra/overrides.yaml) replayed, later overrides winning, into the same run
    directory, from its last checkpoint. Other command lines are returned as they are."""
    # start-up: the command line is parsed before this loads
    import yaml

    requested = [a for a in arguments if a.startswith("resume=")]
    if not requested:
        return arguments
    if len(requested) > 1 or any(a in ("-m", "--multirun") for a in arguments):
        raise ConfigError("resume=<run dir> resumes one run: give it once, without -m")
    run_dir = Path(requested[0].split("=", 1)[1]).expanduser().resolve()
    saved_overrides = run_dir / ".hydra" / "overrides.yaml"
    if not saved_overrides.is_file():
        raise CheckpointError(f"{requested[0]}: {run_dir} is not a posttrain run directory "
                              f"(it has no .hydra/overrides.yaml)")

    from posttrain.run.checkpoints import newest_intact_checkpoint  # start-up: it loads torch and Lightning

    checkpoint = newest_intact_checkpoint(run_dir / "checkpoints")  # last.ckpt, or the newest step's if a kill cut it
    if checkpoint is None:
        raise CheckpointError(f"{requested[0]}: the run has no checkpoint to resume from (no intact last.ckpt or "
                              f"step checkpoint in {run_dir / 'checkpoints'}: it stopped before its first one); "
                              f"start it again instead")
    extra = [a for a in arguments if not a.startswith("resume=")]
    # stop_at_step simulates a preemption: replaying it would stop the resumed run again
    replaced = {override_key(a) for a in extra} | {"ckpt_path", "hydra.run.dir", "callbacks.stop_at_step"}
    replayed = [o for o in yaml.safe_load(saved_overrides.read_text()) or [] if override_key(o) not in replaced]
    return replayed + extra + [f"hydra.run.dir={run_dir}", f"ckpt_path={checkpoint}"]


# A swept group and the config keys its options set: an experiment preset sets algorithm keys.
SWEPT_GROUP_KEYS = {"experiment": ("algorithm",)}


def sweep_arguments(arguments: list[str]) -> list[str]:
    """Let a sweep over a config group set keys that only the swept options have.

    Hydra composes a sweep's own config from the primary defaults and the overrides that are
    not swept, so `-m algorithm=grpo,dapo algorithm.group_size=4` fails against the default
    algorithm (sft has no group_size) before any job starts. Overrides of keys under a swept
    group become `++` overrides (set, or add where missing: Hydra's own remedy); every job
    still composes its own config, and validation names a key its algorithm does not take."""
    # start-up: the command line is parsed before this loads
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    if not any(a in ("-m", "--multirun") for a in arguments):
        return arguments
    overrides = [a for a in arguments if not a.startswith("-") and "=" in a]
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException:
        return arguments  # Hydra reports the malformed override itself
    swept = {o.key_or_group for o in parsed if o.is_sweep_override() and "." not in o.key_or_group}
    prefixes = tuple(f"{key}." for group in swept for key in (group, *SWEPT_GROUP_KEYS.get(group, ())))
    forced = {o.input_line: f"++{o.input_line}" for o in parsed
              if o.type.name == "CHANGE" and not o.is_sweep_override() and o.key_or_group.startswith(prefixes)}
    return [forced.get(a, a) for a in arguments]


def override_key(override: str) -> str:
    """The key an override sets: `+trainer.max_time=1` -> `trainer.max_time`."""
    return override.split("=", 1)[0].lstrip("+~")
