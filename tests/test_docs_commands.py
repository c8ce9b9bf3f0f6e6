"""Every command in the shell blocks of docs/*.md that the README does not already show: each
`posttrain` command composes and passes the start-up config checks (in CI), and each runs as
written with the tiny budget of tests/test_readme.py (`slow`: about 30 runs, 3 minutes; the
README's own commands run in CI). A file of its own so that xdist runs it beside the README's
commands (a test file stays on one worker)."""

from __future__ import annotations

import shlex

import pytest
from omegaconf import OmegaConf

from conftest import compose_config
from posttrain.config.check import check_config
from posttrain.run.boundary import hydra_choices
from test_readme import DOCUMENTS, README, one_value_past_the_first_sweep, readme_commands, run_documented_commands

# what the docs' commands name by placeholder (`outputs/grpo_tiny/runs/<time>`) and the README
# runs before them
PREREQUISITES = {"outputs/grpo_tiny/": "posttrain experiment=grpo_tiny"}


def docs_commands() -> list[str]:
    shown_in_readme = set(readme_commands([README]))
    commands = [c for c in readme_commands(DOCUMENTS) if c not in shown_in_readme]
    needed = [run for name, run in PREREQUISITES.items() if any(name in c for c in commands)]
    return needed + commands


def test_the_docs_commands_include_their_prerequisites():
    commands = docs_commands()
    assert commands[0] == "posttrain experiment=grpo_tiny"
    assert not set(commands[1:]) & set(readme_commands([README]))
    assert any(c.startswith("posttrain algorithm=kdrl teacher=outputs/grpo_tiny") for c in commands)


def composed_overrides(command: str) -> list[str] | None:
    """The overrides a `posttrain` command composes (a sweep: its first job), or None for a
    command that needs no config check here (another program, --help, --cfg) or names an earlier
    run's files (`<time>`: the slow test runs those)."""
    arguments = shlex.split(command)
    if arguments[0] != "posttrain" or "<" in command or {"--help", "--cfg"} & set(arguments):
        return None
    if "-m" not in arguments:
        return arguments[1:]
    # a sweep's first job; Hydra's own keys (the launcher) are not the job's config
    first_job = one_value_past_the_first_sweep(arguments[1:], first_values=1)
    return [a for a in first_job if a != "-m" and not a.startswith(("hydra/", "hydra."))]


def test_every_docs_posttrain_command_composes_and_passes_the_config_checks():
    checked = 0
    for command in docs_commands():
        overrides = composed_overrides(command)
        if overrides is None:
            continue
        cfg = compose_config(overrides)
        OmegaConf.resolve(cfg)
        check_config(cfg, hydra_choices())  # raises, naming the key, on what `posttrain` would refuse
        checked += 1
    assert checked >= 15


@pytest.mark.slow
def test_every_docs_command_runs(tmp_path, embedded_hf_model):
    run_documented_commands(docs_commands(), tmp_path, embedded_hf_model)
