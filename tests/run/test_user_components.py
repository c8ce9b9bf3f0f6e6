"""A researcher's own components through config alone (issue 31, part 4): a Lightning callback
(`callbacks.extra`), a Lightning logger (`logger.extra`) and a reward function
(`reward.components.<name>._target_`), written in a file outside the package, run in a real
`posttrain` job launched the way the console script launches it (its directory, not the working
directory, first on sys.path), so the module is found only through the launch directory. A
mistake in any of them is one line naming the key, before anything trains, with no run dir left."""

import json
import os
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from forked_cli import run_command
from test_input_checks import assert_clean_failure

from posttrain.config.check import check_config
from posttrain.data.sources import build_source
from posttrain.errors import ConfigError
from posttrain.rewards.build import build_reward, check_user_functions
from posttrain.run.user_components import check_user_components, launch_dir

# The user's module: a callback that writes a file when training ends, a logger that keeps
# every metrics dict it is given, a reward that prefers short responses.
USER_MODULE = '''
import json
from pathlib import Path

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger


class WriteOnTrainEnd(Callback):
    def __init__(self, path, message="done"):
        self.path = Path(path)
        self.message = message

    def on_train_end(self, trainer, pl_module):
        self.path.write_text(f"{self.message} at step {trainer.global_step}")


class MetricsToFile(Logger):
    def __init__(self, path):
        super().__init__()
        self.path = Path(path)

    @property
    def name(self):
        return "metrics_to_file"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, "keys": sorted(metrics)}) + "\\n")


def brevity(samples, source, scale):
    return [-scale * len(sample.response) for sample in samples]
'''

# How pip's console script `posttrain` starts: a file in bin/ that imports the entry point, so
# sys.path[0] is bin/, never the working directory (`python -m` would put the latter first).
CONSOLE_SCRIPT = "from posttrain.train import main\n\nif __name__ == '__main__':\n    main()\n"

SHORT_RUN = ("logger=none", "callbacks.progress_bar=none", "eval.num_prompts=4", "eval.batch_size=4",
             "eval.at_start=false", "trainer.max_steps=2", "trainer.val_check_interval=2",
             "callbacks.checkpoint.every_n_train_steps=2")
SHORT_GRPO = (*SHORT_RUN, "algorithm=grpo", "algorithm.warm_start.steps=0", "algorithm.prompts_per_step=2",
              "algorithm.group_size=2", "rollout.max_new_tokens=8")


@pytest.fixture
def project(tmp_path) -> Iterator[Path]:
    """The researcher's project directory (the launch directory), holding their module."""
    directory = tmp_path / "project"
    directory.mkdir()
    (directory / "my_components.py").write_text(textwrap.dedent(USER_MODULE))
    yield directory
    sys.modules.pop("my_components", None)  # imported in this process: the next test's file is another


def posttrain_from(project: Path, *overrides: str, log_dir: Path):
    """`posttrain <overrides>` started as the console script in `project`, without PYTHONPATH."""
    script = project.parent / "bin" / "posttrain"
    script.parent.mkdir(exist_ok=True)
    script.with_suffix(".py").write_text(CONSOLE_SCRIPT)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[2] / "src"))
    command = [sys.executable, str(script.with_suffix(".py")), *overrides, f"paths.log_dir={log_dir}"]
    return run_command(command, capture_output=True, text=True, timeout=300, env=env, cwd=project)


def callback_entry(path: Path, **options) -> str:
    """One `callbacks.extra` entry in Hydra's override syntax."""
    fields = {"_target_": "my_components.WriteOnTrainEnd", "path": f"'{path}'", **options}
    return "{" + ",".join(f"{key}:{value}" for key, value in fields.items()) + "}"


# --- through config alone, in a real run ------------------------------------------------------
def test_a_callback_logger_and_reward_from_a_file_outside_the_package_run_through_config_alone(project, tmp_path):
    done, metrics = tmp_path / "done.txt", tmp_path / "metrics.jsonl"
    result = posttrain_from(
        project, *SHORT_GRPO,
        f"callbacks.extra=[{callback_entry(done, message='hello')}]",
        f"logger.extra=[{{_target_:my_components.MetricsToFile,path:'{metrics}'}}]",
        "+reward.components.short._target_=my_components.brevity", "+reward.components.short.scale=0.01",
        "+reward.components.short.weight=0.5", log_dir=tmp_path / "outputs")
    assert result.returncode == 0, result.stderr + result.stdout
    assert done.read_text() == "hello at step 2"
    logged = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert any("rewards/short/mean" in record["keys"] for record in logged), logged  # the user reward, logged
    assert {record["step"] for record in logged} >= {0, 1}, "a record per training step"
    summary = json.loads(next((tmp_path / "outputs").rglob("summary.json")).read_text())
    assert summary["global_step"] == 2


def test_a_sweep_job_that_changes_directory_still_finds_the_module_in_the_launch_directory(project, tmp_path):
    done = tmp_path / "done.txt"
    result = posttrain_from(project, "-m", *SHORT_RUN, "trainer.max_steps=1", "hydra.job.chdir=true",
                            f"callbacks.extra=[{callback_entry(done)}]", "seed=3", log_dir=tmp_path / "outputs")
    assert result.returncode == 0, result.stderr + result.stdout
    assert done.read_text() == "done at step 1"
    assert list((tmp_path / "outputs" / "multiruns").rglob("summary.json")), "the job ran in its sweep's run dir"


# --- mistakes: one line naming the key, before anything trains ----------------------------------
@pytest.mark.parametrize("override, needles", [
    ("callbacks.extra=[{_target_:no_such_module.Timer}]",
     ["callbacks.extra[0]._target_='no_such_module.Timer' cannot be imported", "ModuleNotFoundError",
      "the launch directory"]),
    ("callbacks.extra=[{_target_:my_components.MetricsToFile,path:x}]",
     [("callbacks.extra[0]._target_='my_components.MetricsToFile' is the class MetricsToFile, not a subclass of "
       "lightning.pytorch.callbacks.Callback")]),
    ("callbacks.extra=[{_target_:my_components.WriteOnTrainEnd,path:x,mesage:hi}]",
     ["unknown option(s) callbacks.extra[0].mesage", "valid options: _target_, path, message"]),
    ("callbacks.extra=[{_target_:my_components.WriteOnTrainEnd,message:hi}]",
     ["callbacks.extra[0]: missing required option(s) ['path'] that my_components.WriteOnTrainEnd needs"]),
    ("logger.extra=[{_target_:my_components.WriteOnTrainEnd,path:x}]",
     [("logger.extra[0]._target_='my_components.WriteOnTrainEnd' is the class WriteOnTrainEnd, not a subclass of "
       "lightning.pytorch.loggers.Logger")]),
])
def test_a_mistake_in_a_user_component_stops_the_run_naming_its_key(override, needles, project, tmp_path):
    log_dir = tmp_path / "outputs"
    message = assert_clean_failure(posttrain_from(project, *SHORT_RUN, override, log_dir=log_dir), log_dir,
                                   "posttrain: error:", *needles)
    assert len(message.strip().splitlines()) == 1, message


def test_entries_without_a_target_are_refused_by_the_config_check(make_config):
    with pytest.raises(ConfigError, match=r"callbacks\.extra=\[\{'path': 'x'\}\] is not valid: expected a list, "
                                          r"each \{_target_: package\.module\.Class"):
        check_config(make_config("callbacks.extra=[{path:x}]"))
    with pytest.raises(ConfigError, match=r"logger\.extra=.* is not valid"):
        check_config(make_config("logger=csv", "logger.extra=[7]"))


def test_the_launch_directory_is_hydras_runtime_cwd(make_config, project, monkeypatch):
    cfg = make_config("callbacks.extra=[{_target_:my_components.WriteOnTrainEnd,path:x}]")
    monkeypatch.chdir(project)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(project))])
    monkeypatch.delitem(sys.modules, "my_components", raising=False)
    with pytest.raises(ConfigError, match="cannot be imported"):
        check_user_components(cfg)  # the config was composed elsewhere: its launch directory is not the project
    assert launch_dir() != project


# --- reward functions: `_target_`, the one convention ---------------------------------------------
def test_a_reward_function_named_by_target_is_imported_checked_and_called(make_config, project, monkeypatch):
    monkeypatch.syspath_prepend(str(project))
    reward = {"name": "mine", "components": {"short": {"_target_": "my_components.brevity", "scale": 0.5}}}
    built = build_reward(reward, None, max_new_tokens=8)
    assert built.components[0][0].fn.__module__ == "my_components"
    with pytest.raises(ConfigError, match=r"reward\.components\.short: missing required option\(s\) \['scale'\]"):
        build_reward({"components": {"short": {"_target_": "my_components.brevity"}}}, None, 8)
    with pytest.raises(ConfigError, match=r"unknown option\(s\) reward\.components\.short\.scael: "
                                          r"my_components\.brevity takes no such argument; valid options: "
                                          r"weight, _target_, scale"):
        build_reward({"components": {"short": {"_target_": "my_components.brevity", "scale": 1, "scael": 2}}}, None, 8)
    # the start-up call on stand-in samples of the default task
    check_user_functions(reward, build_source(make_config().data), max_new_tokens=8)


def test_the_old_target_spelling_is_refused_saying_to_write_target(make_config):
    with pytest.raises(ConfigError, match=r"reward\.components\.mine\.target='my_components\.brevity' is not valid: "
                                          r"expected nothing: this key is now written `_target_`"):
        check_config(make_config("algorithm=grpo", "+reward.components.mine.target=my_components.brevity"))
    with pytest.raises(ConfigError, match=r"reward\.components\.mine\.target is now written "
                                          r"reward\.components\.mine\._target_"):
        build_reward({"components": {"mine": {"target": "my_components.brevity"}}}, None, 8)
