"""Shared test helpers: compose the real config tree the way `posttrain` does."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

from forked_cli import PRELOADED, free_port  # noqa: F401 - free_port: for the test files
from posttrain.conf import CONFIG_DIR


def threads_per_test_process() -> int:
    """Torch threads per test process: the cores shared among the xdist workers. More threads
    than cores make OpenMP's waiting threads spin against each other: the SFT learning test,
    72 s alone, took 1296 s in a full run of two 2-thread workers on 2 cores (with other load on
    the machine). POSTTRAIN_TEST_THREADS overrides."""
    if "POSTTRAIN_TEST_THREADS" in os.environ:
        return int(os.environ["POSTTRAIN_TEST_THREADS"])
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, len(os.sched_getaffinity(0)) // workers)


# the runs these tests start in this process (num_threads: null) and in subprocesses (which
# read OMP_NUM_THREADS) keep to this process's share of the cores
TEST_THREADS = threads_per_test_process()
os.environ["OMP_NUM_THREADS"] = str(TEST_THREADS)
torch.set_num_threads(TEST_THREADS)


# The files that take longest (2026-11-29, summed over their tests in the default selection:
# 112 s down to 50 s), started first. With `--dist loadfile` a file is one unit of work and files
# go out in collection order: one of these collected last would run alone at the end.
LONGEST_FILES = ("test_uneven_ranks.py", "test_config_validation.py", "test_sweeps.py", "test_preemption.py",
                 "test_warm_start_key.py", "test_readme.py", "test_fsdp.py", "test_reasoning_gym.py")


def pytest_collection_modifyitems(items):
    def longest_first(item):
        name = item.path.name
        return LONGEST_FILES.index(name) if name in LONGEST_FILES else len(LONGEST_FILES)

    items.sort(key=longest_first)  # stable: the other files keep their order


def compose_config(overrides: list[str], output_dir: Path | None = None):
    """The config `posttrain <overrides>` would run, with the run dir set to `output_dir`."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=overrides, return_hydra_config=True)
    HydraConfig().set_config(cfg)
    with open_dict(cfg):
        cfg.paths.output_dir = str(output_dir) if output_dir else "/nonexistent-test-output"
        del cfg["hydra"]
    return cfg


def module_from_config(cfg):
    """The training module of a composed config, set up as Lightning would, outside a Trainer."""
    from posttrain.data.sources import build_source
    from posttrain.models.loading import load_tokenizer_and_model
    from posttrain.train import build_module

    source = build_source(cfg.data)
    tokenizer, policy = load_tokenizer_and_model(cfg.model, source.alphabet)
    module = build_module(cfg, policy, tokenizer, source)
    module.setup("fit")
    module.manual_backward = lambda loss: loss.backward()
    if hasattr(module, "learner"):  # online RL: the learner and its parts backward through these steppers
        module.learner.steppers.backward = module.manual_backward
    return module


def rollout_batch(rows: list[list[int]], pad_token_id: int, prompt_ids=None, prompt_mask=None):
    """A RolloutBatch of these response token rows (after the given prompts, or none), as an
    engine returns one: right-padded, in inference mode, nothing truncated or looping."""
    from posttrain.rollout.base import RolloutBatch

    width = max(map(len, rows))
    with torch.inference_mode():
        response_ids = torch.full((len(rows), width), pad_token_id)
        response_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            response_ids[i, :len(row)], response_mask[i, :len(row)] = torch.tensor(row), 1
        flags = torch.zeros(len(rows), dtype=torch.bool)
        if prompt_ids is None:
            prompt_ids, prompt_mask = response_ids[:, :0], response_mask[:, :0]
        return RolloutBatch(prompt_ids, prompt_mask, response_ids, response_mask, torch.zeros(response_ids.shape),
                            flags, repeated=flags.clone())


@pytest.fixture
def make_config(tmp_path):
    def make(*overrides: str, output_dir: Path | None = None):
        return compose_config(list(overrides), output_dir or tmp_path)

    return make


FAST_RUN = ("logger=none", "callbacks.progress_bar=none", "eval.num_prompts=64", "eval.batch_size=64")

EASY_TASK = ("data.min_digits=2", "data.max_digits=2")


def built_once_per_session(tmp_path_factory, worker_id: str, name: str, build) -> Path:
    """A directory `build(directory)` fills, shared by the xdist workers of one test session: a
    worker that finds it built reuses it; one that finds another worker building it builds its
    own rather than wait (waiting would idle a core the build does not use: one thread each)."""
    if worker_id == "master":  # no xdist: this process is the session
        directory = tmp_path_factory.mktemp(name)
        build(directory)
        return directory
    shared = tmp_path_factory.getbasetemp().parent / name  # the session's root, above each worker's
    done = shared / ".built"
    if done.exists():
        return shared
    shared.parent.mkdir(parents=True, exist_ok=True)
    with open(shared.with_name(f"{name}.lock"), "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another worker is building it
            directory = tmp_path_factory.mktemp(name)
            build(directory)
            return directory
        if not done.exists():
            shared.mkdir(exist_ok=True)
            build(shared)
            done.touch()
    return shared


@pytest.fixture(scope="session")
def sft_start(tmp_path_factory, worker_id) -> Path:
    """A briefly SFT-trained tiny policy on 2-digit addition, as an HF directory (shared)."""
    from posttrain.train import run

    def train(out: Path):
        run(compose_config([*FAST_RUN, *EASY_TASK, "trainer.max_steps=120", "trainer.val_check_interval=120",
                            "callbacks.checkpoint.every_n_train_steps=120", "eval.at_start=false"], out))

    return built_once_per_session(tmp_path_factory, worker_id, "sft_start", train) / "hf_model"


def load_benchmark(name: str):
    """A script of benchmarks/ as a module (the folder is scripts, not a package)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def embedded_hf_model(tmp_path_factory) -> Path:
    """`model=tiny` (random init) saved as an HF directory, with its tokenizer."""
    from omegaconf import OmegaConf

    from posttrain.conf import CONFIG_DIR
    from posttrain.data.sources import ArithmeticSource
    from posttrain.models.loading import load_tokenizer_and_model

    directory = tmp_path_factory.mktemp("embedded_hf_model")
    tokenizer, model = load_tokenizer_and_model(OmegaConf.load(Path(CONFIG_DIR) / "model" / "tiny.yaml"),
                                                ArithmeticSource().alphabet)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_hf_model(tmp_path_factory):
    """``tiny_hf_model(family)``: the directory of a tiny model in the real on-disk format of
    ``family`` (qwen2, qwen3, llama, qwen2_base; see tests/hf_models.py), built once a session."""
    from hf_models import make_tiny_hf_model

    built: dict[str, Path] = {}

    def get(family: str = "qwen2") -> Path:
        if family not in built:
            built[family] = make_tiny_hf_model(tmp_path_factory.mktemp(f"hf_{family}") / f"tiny-{family}", family)
        return built[family]

    return get


def rl_config(make_config, sft_start, *overrides, output_dir=None):
    return make_config(*FAST_RUN, *EASY_TASK, f"model.init_from={sft_start}", "algorithm.prompts_per_step=4",
                       "algorithm.group_size=4", "trainer.max_steps=2", "trainer.val_check_interval=2",
                       "callbacks.checkpoint.every_n_train_steps=2", "eval.at_start=false", *overrides,
                       output_dir=output_dir)


def make_reward_model_dir(directory: Path, tokenizer, seed: int, context: int = 128) -> Path:
    """A tiny one-label Qwen2 sequence classifier over `tokenizer` with `context` positions, saved with it."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=context,
                         num_labels=1, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = Qwen2ForSequenceClassification(config)
    torch.nn.init.normal_(model.score.weight, std=1.0)  # scores of order 1, so they differ visibly
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


# how a job of 2 ranks on this machine is launched (`torchrun --standalone`, gloo on CPU): the
# command before `-m posttrain.train <overrides>`; torchrun picks a free port itself
TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2")

# how tests start the ranks of a job as processes of their own: forked from one server per test
# process that imported torch, Lightning and transformers once, instead of "spawn", whose every
# rank spends about 11 s of CPU importing them again. The server only imports (see
# tests/forked_cli.py: a parallel OpenMP region before a fork would hang the child).
RANKS_START_METHOD = "forkserver"
multiprocessing.set_forkserver_preload(list(PRELOADED))


def run_ranks(worker, *args, world: int = 2) -> None:
    """``worker(rank, *args)`` in ``world`` processes of their own; raises what a rank raised."""
    torch.multiprocessing.start_processes(worker, args=args, nprocs=world, join=True, start_method=RANKS_START_METHOD)


def restores_after_fit_start():
    """A one-process CPU strategy that restores a checkpoint where ModelParallelStrategy
    (trainer=ddp, fsdp) does: after on_fit_start."""
    from lightning.pytorch.strategies import SingleDeviceStrategy

    class RestoresAfterFitStart(SingleDeviceStrategy):
        @property
        def restore_checkpoint_after_setup(self) -> bool:
            return True

    return RestoresAfterFitStart(torch.device("cpu"))
