"""Every command in the shell blocks of docs/*.md that the README does not already show runs as
written, with the tiny budget of tests/test_readme.py. A file of its own so that xdist runs it
beside the README's commands (a test file stays on one worker)."""

from __future__ import annotations

from test_readme import DOCUMENTS, README, readme_commands, run_documented_commands

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


def test_every_docs_command_runs(tmp_path, embedded_hf_model):
    run_documented_commands(docs_commands(), tmp_path, embedded_hf_model)
