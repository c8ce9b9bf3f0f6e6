"""The code part of the warm start's cache key is the import closure of what the SFT run executes
(prepare/source_key.py): editing a policy loss, a reward, the RL module or a config rule leaves
it unchanged; editing the SFT loss, the tiny model or the data changes it. Each edit is made in a
copy of src/posttrain, never in the tree under test."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from posttrain.prepare.cache import SFT_ENTRIES, code_version
from posttrain.prepare.source_key import PACKAGE, module_files, sft_closure, source_digest
from posttrain.prepare.warm_start import sft_entries, warm_start_plan

from conftest import FAST_RUN

digest = source_digest.__wrapped__  # uncached: the copy changes between calls


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """A copy of src/posttrain's source files."""
    copy = tmp_path_factory.mktemp("src") / "posttrain"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return copy


def key_after_edit(tree: Path, relative: str, edit: str) -> tuple[str, str]:
    """The source digest of `tree` before and after `edit` is appended to its file `relative`
    (the file is restored afterwards)."""
    path = tree / relative
    before = digest(SFT_ENTRIES, tree)
    original = path.read_text()
    try:
        path.write_text(original + edit)
        return before, digest(SFT_ENTRIES, tree)
    finally:
        path.write_text(original)


# what one edits to add a loss, a reward, an RL capability or a config rule; and the branches of
# run() an SFT run never takes (imports marked "cache key")
@pytest.mark.parametrize("relative", ["core/policy_loss.py", "rewards/components.py", "core/kl.py",
                                      "core/advantages.py", "algorithms/online/module.py",
                                      "algorithms/online/parts/critic.py", "config/algorithm.py",
                                      "config/check.py", "estimate/memory.py", "prepare/teachers.py",
                                      "prepare/preference_pairs.py", "rewards/build.py"])
def test_editing_what_the_sft_run_does_not_run_keeps_the_key(tree, relative):
    before, after = key_after_edit(tree, relative, "\nEDITED = 1\n")
    assert after == before, f"editing {relative} would retrain every cached warm start"


def test_exporting_a_new_loss_from_core_keeps_the_key(tree):
    """core/__init__.py only names things: a new export there is not the SFT run's code."""
    before, after = key_after_edit(tree, "core/__init__.py", "\nfrom .policy_loss import policy_loss as new_loss\n")
    assert after == before


# the SFT loss (algorithms/sft.py training_step), the embedded tiny model, the generated task
# data, the sampler of its held-out eval, the recipe that trains it, the cache itself
@pytest.mark.parametrize("relative", ["algorithms/sft.py", "models/tiny.py", "algorithms/base.py",
                                      "data/arithmetic.py", "rollout/fast.py", "models/loading.py",
                                      "train.py", "prepare/warm_start.py"])
def test_editing_what_the_sft_run_runs_changes_the_key(tree, relative):
    before, after = key_after_edit(tree, relative, "\nEDITED = 1\n")
    assert after != before, f"editing {relative} would share a stale warm start"


def test_the_copy_keys_as_the_tree_does(tree):
    """The key reads paths relative to the package: the same sources anywhere, the same key."""
    assert [p.relative_to(tree) for p in sft_closure(SFT_ENTRIES, tree)] == \
        [p.relative_to(PACKAGE) for p in sft_closure(SFT_ENTRIES)]


def test_a_new_module_the_sft_run_imports_enters_the_key(tree):
    """No list to keep: a helper module the SFT module starts importing is in the key."""
    helper, sft = tree / "algorithms" / "sft_helper.py", tree / "algorithms" / "sft.py"
    original = sft.read_text()
    try:
        helper.write_text("SCALE = 1.0\n")
        sft.write_text(original.replace("from posttrain.algorithms.base import OfflineModule",
                                        "from posttrain.algorithms.base import OfflineModule\n"
                                        "from posttrain.algorithms.sft_helper import SCALE", 1))
        assert helper in sft_closure(SFT_ENTRIES, tree)
        before = digest(SFT_ENTRIES, tree)
        helper.write_text("SCALE = 2.0\n")
        assert digest(SFT_ENTRIES, tree) != before
    finally:
        sft.write_text(original)
        helper.unlink(missing_ok=True)


def test_the_closure_holds_no_rl_module():
    modules = {path: name for name, path in module_files(PACKAGE).items()}
    closure = {modules[path] for path in sft_closure(SFT_ENTRIES)}
    assert {"posttrain.algorithms.sft", "posttrain.models.tiny", "posttrain.train"} <= closure
    rl = {name for name in closure if name.startswith(("posttrain.algorithms.online", "posttrain.config",
                                                       "posttrain.estimate", "posttrain.rewards.components",
                                                       "posttrain.rewards.build", "posttrain.prepare.teachers"))}
    assert not rl and "posttrain.core.policy_loss" not in closure and "posttrain.core.kl" not in closure


def test_the_warm_starts_entries_are_its_recipe_and_its_module(make_config):
    cfg = make_config("algorithm=grpo")
    OmegaConf.resolve(cfg)
    sft_cfg, _ = warm_start_plan(cfg)
    assert sft_entries(sft_cfg) == ("posttrain.train", "posttrain.algorithms.sft")


def test_the_key_still_covers_the_config_values_the_sft_run_reads(make_config):
    def key(*overrides):
        cfg = make_config("algorithm=grpo", *overrides)
        OmegaConf.resolve(cfg)
        return warm_start_plan(cfg)[1]

    plain = key()
    assert key("model.hidden_size=48") != plain
    assert key("algorithm.warm_start.lr=0.001") != plain
    assert key("kl_estimator=k1") == plain  # the RL run's settings: not the warm start's
    assert key(f"paths.output_dir={Path('/elsewhere')}") == plain
    assert code_version() in code_version.__wrapped__()  # the same code, the same version string


SFT_IMPORTS = """
import atexit, sys
sys.argv = ["posttrain", *sys.argv[1:]]
atexit.register(lambda: print("imported", " ".join(m for m in sys.modules if m.startswith("posttrain"))))
from posttrain.train import main
main()
"""


def test_an_sft_run_imports_nothing_the_static_reading_misses(tmp_path):
    """The closure is read statically; the modules an SFT run really imports (sys.modules after a
    short SFT run) must all be ones the reading sees: none loaded through importlib or a
    `_target_` the entries leave out. (It imports more than the key holds: the re-exports of
    core/ and rewards/, the start-up checks; see prepare/source_key.py.)"""
    result = subprocess.run([sys.executable, "-c", SFT_IMPORTS, *FAST_RUN, "model.hidden_size=32",
                             "trainer.max_steps=2", "trainer.val_check_interval=2", "eval.at_start=false",
                             f"paths.log_dir={tmp_path}"], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("imported ")]
    imported = set(line.split()[1:])
    assert "posttrain.algorithms.sft" in imported
    modules = {path: name for name, path in module_files(PACKAGE).items()}
    readable = {modules[path] for path in sft_closure(SFT_ENTRIES, cut=(), by_name=False)}
    assert imported <= readable, sorted(imported - readable)
