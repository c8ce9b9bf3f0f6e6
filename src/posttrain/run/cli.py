"""The command line before Hydra parses it: `resume=<run dir>` becomes the run's own command
line, a sweep over a group may set keys only its options have, and a config group option that
does not exist is refused in one line naming the nearest ones (Hydra lists them all)."""

from __future__ import annotations

import difflib
from pathlib import Path

from posttrain.conf import CONFIG_DIR
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


# A swept group and the config keys its options set: an experiment (a preset) sets algorithm keys.
SWEPT_GROUP_KEYS = {"experiment": ("algorithm",), "preset": ("algorithm",)}


def sweep_arguments(arguments: list[str]) -> list[str]:
    """Let a sweep over a config group set keys that only the swept options have.

    Hydra composes a sweep's own config from the primary defaults and the overrides that are
    not swept, so `-m algorithm=grpo,dapo algorithm.group_size=4` fails against the default
    algorithm (sft has no group_size) before any job starts. Overrides of keys under a swept
    group become `++` overrides (set, or add where missing: Hydra's own remedy); every job
    still composes its own config, and validation names a key its algorithm does not take."""
    if not any(a in ("-m", "--multirun") for a in arguments):
        return arguments
    parsed = parsed_overrides(arguments)
    if parsed is None:
        return arguments  # Hydra reports the malformed override itself
    swept = {o.key_or_group for o in parsed if o.is_sweep_override() and "." not in o.key_or_group}
    prefixes = tuple(f"{key}." for group in swept for key in (group, *SWEPT_GROUP_KEYS.get(group, ())))
    forced = {o.input_line: f"++{o.input_line}" for o in parsed
              if o.type.name == "CHANGE" and not o.is_sweep_override() and o.key_or_group.startswith(prefixes)}
    return [forced.get(a, a) for a in arguments]


def override_key(override: str) -> str:
    """The key an override sets: `+trainer.max_time=1` -> `trainer.max_time`."""
    return override.split("=", 1)[0].lstrip("+~")


def parsed_overrides(arguments: list[str]) -> list | None:
    """The overrides of a command line as Hydra parses them (flags such as -m left out), or
    None when one is malformed (Hydra then reports it itself)."""
    # start-up: the command line is parsed before this loads
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        return OverridesParser.create().parse_overrides([a for a in arguments if not a.startswith("-") and "=" in a])
    except HydraException:
        return None


# Groups whose options come also from Hydra and its plugins (hydra/launcher=basic): Hydra checks them.
HYDRA_OWN_GROUPS = "hydra/"
# Arguments that add config directories, whose options only Hydra knows: it checks them all then.
OTHER_CONFIG_DIRS = ("--config-dir", "-cd", "--config-path", "-cp", "hydra.searchpath")


def check_group_options(arguments: list[str], config_dir: Path = Path(CONFIG_DIR)) -> None:
    """Refuse an override that chooses an option a config group of `config_dir` does not have
    (`algorithm=grpoo`, or one value of a sweep `-m advantage=gae,gae2`) with a ConfigError
    naming the group and its nearest options, before Hydra composes anything (Hydra would print
    every option and its search path) and before a run directory is made."""
    from hydra.core.override_parser.types import Glob  # start-up: as parsed_overrides

    if any(a.lstrip("+").startswith(OTHER_CONFIG_DIRS) for a in arguments):
        return
    for override in parsed_overrides(arguments) or []:
        group = override.key_or_group
        group_dir = config_dir / group
        value = override.value()
        if group.startswith(HYDRA_OWN_GROUPS) or not group_dir.is_dir() or value is None or isinstance(value, Glob):
            continue  # a config key, not a group; or `~group` / `group=null` (no option), or a glob sweep
        if override.is_sweep_override():
            chosen = list(override.sweep_string_iterator())
        else:
            chosen = [str(v) for v in value] if isinstance(value, list) else [override.get_value_element_as_str()]
        options = sorted(p.stem for p in group_dir.glob("*.yaml"))
        for option in chosen:
            if option not in options:
                raise ConfigError(unknown_option_message(group, option, options))


def unknown_option_message(group: str, option: str, options: list[str]) -> str:
    nearest = difflib.get_close_matches(option, options, n=3)
    offer = f"did you mean {', '.join(nearest)}?" if nearest else f"its options are {', '.join(options)}"
    return f"{group}={option}: config group {group} has no option {option!r}; {offer}"
