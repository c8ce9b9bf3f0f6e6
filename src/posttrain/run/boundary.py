"""The one error boundary of the Hydra commands (`posttrain`, `posttrain-eval`, `posttrain-sample`),
and what they share: the command itself (`hydra_command`), the user-facing logger, the Lightning
warnings silenced by design, the Hydra choices.

Inside the boundary a user's mistake (a `PosttrainError`, an OmegaConf error) is one line
`<program>: error: ...` and exit 1, and a run directory that holds nothing of the job's own is
removed; a signal that stopped the job after its checkpoint exits with the code `Preemption`
chose; anything else is a bug, printed once with its traceback (also kept in the log file)."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import hydra
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from posttrain.conf import CONFIG_DIR
from posttrain.errors import PosttrainError, PreemptedError
from posttrain.run.cli import check_group_options
from posttrain.run.console import log, setup_console
from posttrain.run.run_dir import remove_unused_run_dir

# Lightning warnings that our setup triggers by design, silenced so real ones stand out:
# the frozen reference model is in eval mode; RL modules optimise manually and checkpoint
# after the step on purpose; a deprecation inside Lightning's own pytree helper.
EXPECTED_WARNINGS = (
    r"Found \d+ module\(s\) in eval mode",
    r"Using ModelCheckpoint with manual optimization",
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
)


def silence_expected_warnings() -> None:
    for pattern in EXPECTED_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)


def hydra_choices() -> dict[str, str]:
    """The config group options this job composed (`algorithm: grpo`, ...); {} outside Hydra."""
    from hydra.core.hydra_config import HydraConfig  # start-up: Hydra's internals load only inside a job

    if not HydraConfig.initialized():
        return {}
    return {k: str(v) for k, v in HydraConfig.get().runtime.choices.items() if not k.startswith("hydra")}


def run_inside_boundary(program: str, job: Callable[[], object], output_dir: Path, log_dir: Path,
                        log_name: str) -> None:
    """Run `job()` as the command `program`; every way out of it ends here (see the module)."""
    setup_console()  # Lightning's own console handler (every line twice), HF progress bars, warnings to the log
    try:
        job()
    except PreemptedError as err:  # stopped by a signal after a checkpoint (Preemption said so): not finished
        sys.exit(err.exit_code)
    except (PosttrainError, OmegaConfBaseException) as err:
        log.error(f"{program}: error: {err}")
        remove_unused_run_dir(output_dir, log_dir, log_name=log_name)
        sys.exit(1)
    except Exception:  # a bug: its traceback printed once, and kept in the log file
        log.exception(f"{program}: unexpected error (a bug: please report it with this traceback)")
        sys.exit(1)


def hydra_command(program: str, config_name: str, job: Callable[[DictConfig], object], log_name: str,
                  rewrite_arguments: Callable[[list[str]], list[str]] = list) -> Callable[[], None]:
    """The console entry point of a Hydra command: its arguments rewritten (`resume=`, sweeps)
    and its group options checked before Hydra composes anything (Hydra would list every option
    and make a run dir), then `job(cfg)` run inside the boundary, logging to `log_name`."""
    @hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name=config_name)
    def run_job(cfg: DictConfig) -> None:
        run_inside_boundary(program, lambda: job(cfg), Path(cfg.paths.output_dir), Path(cfg.paths.log_dir),
                            log_name=log_name)

    def main() -> None:
        try:
            arguments = rewrite_arguments(sys.argv[1:])
            check_group_options(arguments)
        except PosttrainError as err:
            print(f"{program}: error: {err}", file=sys.stderr)
            sys.exit(1)
        sys.argv[1:] = arguments
        run_job()

    return main
