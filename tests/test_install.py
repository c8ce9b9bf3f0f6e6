"""`pip install .` (not only `-e`) gives a working `posttrain` from any directory, and users add
config groups of their own from their own directory without editing the package."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGED_CONF = REPO / "src" / "posttrain" / "conf"
TINY_JOB = ["algorithm=sft", "trainer.max_steps=2", "trainer.val_check_interval=2", "logger=none",
            "callbacks.progress_bar=none", "eval.num_prompts=8", "eval.batch_size=8", "eval.at_start=false",
            "num_threads=1"]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """posttrain built as a wheel and installed (without dependencies, which this environment
    has) into a directory of its own: a `site` that holds no source tree."""
    build = tmp_path_factory.mktemp("wheel")
    # with setuptools at hand, build with it; else pip fetches it into an isolated build env
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", *isolation,
                    "--quiet", "-w", str(build)], check=True, capture_output=True)
    (wheel,) = build.glob("posttrain-*.whl")
    site = build / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target", str(site), str(wheel)],
                   check=True, capture_output=True)
    return wheel


def run_installed(wheel: Path, cwd: Path, *arguments: str) -> subprocess.CompletedProcess:
    """`posttrain <arguments>` from ``cwd`` with the installed copy first on the path."""
    site = wheel.parent / "site"
    env = {**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    code = ("import sys, posttrain, posttrain.train as t; "
            f"assert posttrain.__file__.startswith({str(site)!r}), posttrain.__file__; "
            "sys.argv = ['posttrain', *sys.argv[1:]]; t.main()")
    return subprocess.run([sys.executable, "-c", code, *arguments], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def test_the_wheel_carries_every_config_group_and_the_sweeps(installed):
    names = set(zipfile.ZipFile(installed).namelist())
    for path in PACKAGED_CONF.rglob("*.yaml"):
        assert f"posttrain/conf/{path.relative_to(PACKAGED_CONF).as_posix()}" in names
    assert "posttrain/conf/sweep/grpo_family.yaml" in names  # sweeps/ links to conf/sweep


def test_an_installed_posttrain_trains_from_another_directory(installed, tmp_path):
    result = run_installed(installed, tmp_path, *TINY_JOB)
    assert result.returncode == 0, result.stderr[-3000:]
    (summary,) = (tmp_path / "outputs").glob("sft/runs/*/summary.json")
    assert (summary.parent / "hf_model" / "model.safetensors").is_file()


def write_user_option(directory: Path) -> Path:
    """A user's own algorithm option, built on the packaged sft by a defaults list."""
    group = directory / "algorithm"
    group.mkdir(parents=True)
    (group / "my_sft.yaml").write_text("defaults:\n  - sft\n  - _self_\nbatch_size: 3\n")
    return directory


@pytest.mark.parametrize("how", ["--config-dir", "hydra.searchpath"])
def test_users_add_config_options_from_their_own_directory(installed, tmp_path, how):
    conf = write_user_option(tmp_path / "my_conf")
    where = ["--config-dir", str(conf)] if how == "--config-dir" else [f"hydra.searchpath=[file://{conf}]"]
    result = run_installed(installed, tmp_path, *where, "algorithm=my_sft", "--cfg", "job")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "batch_size: 3" in result.stdout and "name: sft" in result.stdout
