"""rollout=vllm_server (rollout/vllm_server.py, vllm_serve.py): a vLLM server in its own process.

The tests marked `vllm` start real servers and need vLLM's interpreter: they run where
$POSTTRAIN_VLLM_PYTHON names it (a venv with vLLM, e.g. /work/vllm-venv/bin/python) and are
skipped elsewhere. On a 2-core CPU a server starts in about 80 s; the tests of one process
share it while the model and settings stay the same (the engines of a process share their
server). The others (errors, weights, requests, config rules) need no vLLM and run everywhere.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from posttrain.config.check import check_config
from posttrain.errors import ConfigError
from posttrain.models.tiny import build_tiny_model
from posttrain.rollout import SamplingParams, build_rollout, engine_options
from posttrain.rollout import vllm_server
from posttrain.rollout.vllm_server import VLLMServerEngine, fingerprint, served_weights, shared_root

from conftest import EASY_TASK, FAST_RUN, module_from_config, rl_config

VLLM_PYTHON = os.environ.get("POSTTRAIN_VLLM_PYTHON")
requires_vllm = pytest.mark.skipif(
    not (VLLM_PYTHON and os.access(VLLM_PYTHON, os.X_OK)),
    reason="needs vLLM's interpreter: set POSTTRAIN_VLLM_PYTHON to the python of a venv with vllm")
# A small KV cache (host memory on the CPU) and the server's python
SERVED = ("rollout=vllm_server", f"rollout.server_python={VLLM_PYTHON}", "rollout.kv_cache_gib=0.25")


def processes_under(pid: int) -> set[int]:
    """`pid` and every process descending from it, now."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        current = todo.pop()
        found.add(current)
        todo.extend(children.get(current, []))
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# ----------------------------------------------------------------------------- without vLLM


def test_a_missing_python_is_an_error_naming_the_key():
    engine = VLLMServerEngine(server_python="/nonexistent/bin/python")
    model = build_tiny_model(vocab_size=20)
    ids = torch.tensor([[3, 4, 5]])
    with pytest.raises(ConfigError, match=r"rollout\.server_python='/nonexistent/bin/python'"):
        engine.generate(model, ids, torch.ones_like(ids), SamplingParams(max_new_tokens=2), 1, 0)


def test_a_python_without_vllm_is_an_error_naming_the_key():
    """This interpreter has no vLLM: the server exits at once, and the error says which key."""
    engine = VLLMServerEngine(server_python=sys.executable, startup_timeout_s=120)
    model = build_tiny_model(vocab_size=20)
    ids = torch.tensor([[3, 4, 5]])
    with pytest.raises(ConfigError, match=r"(?s)exited with code .*rollout\.server_python=.*No module named 'vllm'"):
        engine.generate(model, ids, torch.ones_like(ids), SamplingParams(max_new_tokens=2), 1, 0)
    assert not (shared_root() / f"posttrain-vllm-pid{os.getpid()}").exists()  # its log is in the message


def test_a_port_taken_is_an_error_naming_the_key():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        engine = VLLMServerEngine(server_python=sys.executable, port=port)
        ids = torch.tensor([[3, 4, 5]])
        with pytest.raises(ConfigError, match=rf"rollout\.port={port} is taken"):
            engine.generate(build_tiny_model(vocab_size=20), ids, torch.ones_like(ids),
                            SamplingParams(max_new_tokens=2), 1, 0)


def test_the_config_checks_name_the_server_python(make_config):
    cfg = make_config(*FAST_RUN, "algorithm=grpo", "rollout=vllm_server", "rollout.server_python=/nonexistent/python")
    with pytest.raises(ConfigError, match=r"rollout\.server_python='/nonexistent/python' is not an executable"):
        check_config(cfg)
    cfg = make_config(*FAST_RUN, "algorithm=grpo", "rollout=vllm_server", "rollout.top_k=5", "rollout.temperature=0.7")
    with pytest.raises(ConfigError, match="needs rollout.temperature=1"):
        check_config(cfg)
    cfg = make_config(*FAST_RUN, "algorithm=grpo", "rollout=vllm_server", f"rollout.server_python={sys.executable}")
    check_config(cfg)  # the composed defaults are valid
    engine = build_rollout("vllm_server", **engine_options(cfg.rollout))
    assert engine.server_python == sys.executable and engine.logprobs_mode == "processed_logprobs"


def test_weights_are_pushed_once_per_storage_and_fingerprinted():
    model = build_tiny_model(vocab_size=20)  # tied embeddings: the LM head is the embedding
    weights = served_weights(model, None)
    assert "lm_head.weight" not in weights and "model.embed_tokens.weight" in weights
    assert all(t.is_contiguous() and t.device.type == "cpu" for t in weights.values())
    assert served_weights(model, torch.bfloat16)["model.norm.weight"].dtype == torch.bfloat16
    tag = fingerprint(weights)
    assert fingerprint(served_weights(model, None)) == tag  # the same weights, the same name
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[3, 7] += 1e-3
    assert fingerprint(served_weights(model, None)) != tag


def test_each_row_is_one_request_with_its_own_seed():
    engine = VLLMServerEngine(top_k=0)
    params = SamplingParams(max_new_tokens=5, temperature=0.8)
    bodies = engine._request_bodies([[1, 2], [1, 2], [3]], params, [0, 9], torch.Generator().manual_seed(3))
    assert [b["prompt"] for b in bodies] == [[1, 2], [1, 2], [3]]
    assert len({b["seed"] for b in bodies}) == 3  # the same prompt twice: two different samples
    again = engine._request_bodies([[1, 2], [1, 2], [3]], params, [0, 9], torch.Generator().manual_seed(3))
    assert [b["seed"] for b in again] == [b["seed"] for b in bodies]  # drawn from the generator: repeatable
    assert bodies[0]["stop_token_ids"] == [0, 9] and bodies[0]["logprobs"] == 0 and bodies[0]["return_token_ids"]
    greedy = engine._request_bodies([[1]], SamplingParams(max_new_tokens=2, greedy=True), [0], None)[0]
    assert greedy["temperature"] == 0.0 and "seed" not in greedy


# ----------------------------------------------------------------------------- with vLLM


@pytest.fixture
def served_config(make_config, sft_start):
    """The config of a short GRPO run of the SFT-started tiny policy through a served engine."""
    return lambda *overrides, output_dir=None: rl_config(make_config, sft_start, "algorithm=grpo", *SERVED, *overrides,
                                                         output_dir=output_dir)


def hf_logprobs(model, batch) -> torch.Tensor:
    """log_softmax(logits) of each response token, by a plain forward of the whole sequence."""
    ids = torch.cat([batch.prompt_ids, batch.response_ids], dim=1)
    attention = torch.cat([batch.prompt_mask, batch.response_mask], dim=1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention,
                       position_ids=(attention.cumsum(1) - 1).clamp(min=0)).logits
    width = batch.prompt_ids.shape[1]
    return logits[:, width - 1:-1].float().log_softmax(-1).gather(-1, batch.response_ids[..., None])[..., 0]


@pytest.mark.vllm
@requires_vllm
class TestServed:
    def test_samples_the_policy_and_follows_its_updates(self, served_config):
        cfg = served_config()
        module = module_from_config(cfg)
        engine, policy, tokenizer = module.engine, module.policy, module.tokenizer
        assert isinstance(engine, VLLMServerEngine)
        ids = torch.tensor([tokenizer.encode("12+34=")] * 4)
        mask = torch.ones_like(ids)
        eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
        params = SamplingParams(max_new_tokens=8, temperature=1.0)
        batch = engine.generate(policy, ids, mask, params, eos, pad, generator=torch.Generator().manual_seed(0))
        server = engine._server
        first = server.weights()
        assert first["tag"] == engine.tag and server.current_tag() == engine.tag
        real = batch.response_mask.bool()
        gap = (hf_logprobs(policy, batch) - batch.logprobs)[real].abs().max().item()
        assert gap < 1e-4, gap  # the server samples the policy's own weights
        greedy = SamplingParams(max_new_tokens=8, greedy=True)
        before = engine.generate(policy, ids[:1], mask[:1], greedy, eos, pad)
        hf = policy.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=8, do_sample=False,
                             eos_token_id=eos, pad_token_id=pad)[:, ids.shape[1]:]
        assert before.response_ids[0, :hf.shape[1]][before.response_mask[0, :hf.shape[1]].bool()].tolist() == \
            hf[0][before.response_mask[0, :hf.shape[1]].bool()].tolist()
        # a step's worth of change: the next generation pushes, the tag advances, the outputs follow
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        engine.policy_updated()
        synced = engine.sync_seconds
        after = engine.generate(policy, ids[:1], mask[:1], greedy, eos, pad)
        assert engine.sync_seconds > synced  # the push's seconds are counted (benchmarks read them)
        second = server.weights()
        assert second["loads"] == first["loads"] + 1 and second["tag"] == engine.tag != first["tag"]
        assert not torch.allclose(after.logprobs, before.logprobs)  # the server's outputs follow the push
        moved = engine.generate(policy, ids, mask, params, eos, pad, generator=torch.Generator().manual_seed(0))
        gap = (hf_logprobs(policy, moved) - moved.logprobs)[moved.response_mask.bool()].abs().max().item()
        assert gap < 1e-4, gap
        # nothing changed: no push
        engine.generate(policy, ids[:1], mask[:1], greedy, eos, pad)
        assert server.weights()["loads"] == second["loads"]

    def test_a_grpo_run_trains_through_the_server(self, served_config, tmp_path):
        from posttrain.train import run

        cfg = served_config("trainer.max_steps=3", "trainer.val_check_interval=3", output_dir=tmp_path)
        started = time.perf_counter()
        summary = run(cfg, announce=False)
        assert summary["global_step"] == 3
        metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        steps = [m for m in metrics if "rollout/mismatch/kl" in m]
        assert len(steps) == 3
        for m in steps:  # on-policy: the sampler's log-probs are the trainer's up to float rounding
            assert m["rollout/mismatch/abs_log_ratio_max"] < 1e-3, m
        server = vllm_server._SERVERS[f"pid{os.getpid()}"]
        assert server.weights()["loads"] >= 3  # a push before each step's sampling
        print(f"grpo through the server: {time.perf_counter() - started:.1f} s, pushes "
              f"{[round(s, 3) for s in server.push_seconds]} s")

    @pytest.mark.slow  # 14 s; the weights' tag per push is checked in the first served test
    def test_a_producer_one_version_ahead_samples_through_the_same_server(self, served_config, tmp_path):
        from posttrain.train import run

        cfg = served_config("trainer.max_steps=3", "trainer.val_check_interval=3", "rollout.max_staleness=1",
                            "rollout.correction.tis=token", output_dir=tmp_path)
        summary = run(cfg, announce=False)
        assert summary["global_step"] == 3
        metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        steps = [m for m in metrics if "rollout/staleness_max" in m]
        assert steps and all(m["rollout/staleness_max"] <= 1 for m in steps)
        assert any(m["rollout/staleness_max"] == 1 for m in steps[1:])  # it did sample ahead
        # the batch sampled by the current weights matches them (no lag, no mismatch)
        for m in steps:
            if m["rollout/staleness_max"] == 0:
                assert m["rollout/mismatch/abs_log_ratio_max"] < 1e-3, m
        assert len(list(shared_root().glob(f"posttrain-vllm-pid{os.getpid()}"))) == 1  # one server

    @pytest.mark.slow  # 42 s, a server of its own; episodes through the engine interface run in tests/envs/test_episodes.py
    def test_a_multi_turn_environment_plays_through_the_server(self, make_config, tmp_path):
        from posttrain.train import run

        cfg = make_config(*FAST_RUN, *SERVED, "experiment=guess_number", "algorithm.warm_start.steps=0",
                          "algorithm.prompts_per_step=2", "algorithm.group_size=4", "trainer.max_steps=2",
                          "trainer.val_check_interval=2", "eval.num_prompts=8", "eval.batch_size=8",
                          "eval.panel.size=4", "eval.at_start=false")
        summary = run(cfg, announce=False)
        assert summary["global_step"] == 2 and 1.0 <= summary["eval/episode/turns"] <= 3.0
        metrics = [json.loads(line) for line in (Path(cfg.paths.output_dir) / "metrics.jsonl").read_text().splitlines()]
        steps = [m for m in metrics if "episode/turns" in m]
        assert steps and all(m["rollout/mismatch/abs_log_ratio_max"] < 1e-3 for m in steps)

    @pytest.mark.slow  # 62 s (a server and two ranks); CI runs the other served cases: -m 'vllm and slow' runs it
    def test_two_ddp_ranks_share_one_server(self, sft_start, tmp_path):
        """Under torchrun both ranks sample through one server (one directory, one start), each
        with its own requests; their weights are the same, so one push serves both."""
        from conftest import TORCHRUN

        overrides = ["trainer=ddp", "algorithm=grpo", f"model.init_from={sft_start}", *EASY_TASK, *SERVED,
                     "algorithm.prompts_per_step=2", "algorithm.group_size=4", "trainer.max_steps=2",
                     "trainer.val_check_interval=2", "eval.num_prompts=32", "eval.batch_size=32", "eval.at_start=false",
                     "logger=csv", "callbacks.progress_bar=none", f"hydra.run.dir={tmp_path}/run",
                     f"paths.cache_dir={tmp_path}/cache"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        result = subprocess.run([*TORCHRUN, "-m", "posttrain.train", *overrides], capture_output=True, text=True,
                                env=env, timeout=900)
        assert result.returncode == 0, result.stderr[-3000:]
        output = result.stdout + result.stderr
        assert output.count("vLLM serves at") == 1, output[-3000:]
        metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        steps = [m for m in metrics if "rollout/mismatch/kl" in m]
        assert len(steps) == 2 and all(m["rollout/mismatch/abs_log_ratio_max"] < 1e-3 for m in steps)
        assert not list(shared_root().glob("posttrain-vllm-ddp-*"))  # stopped with the job

    def test_the_server_goes_with_a_trainer_killed_by_sigkill(self, sft_start, tmp_path):
        overrides = [*FAST_RUN, *EASY_TASK, *SERVED, f"model.init_from={sft_start}", "algorithm=grpo",
                     "algorithm.prompts_per_step=2", "algorithm.group_size=2", "trainer.max_steps=100000",
                     "eval.at_start=false", f"paths.output_dir={tmp_path}"]
        trainer = subprocess.Popen([sys.executable, "-m", "posttrain.train", *overrides], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
        directory = shared_root() / f"posttrain-vllm-pid{trainer.pid}"
        try:
            deadline = time.monotonic() + 600
            while not (directory / "weights.tag").exists():  # serving, and the first weights pushed
                assert trainer.poll() is None, "the trainer stopped before its server started"
                assert time.monotonic() < deadline, "no server within 600 s"
                time.sleep(1)
            supervisor = json.loads((directory / "server.json").read_text())["supervisor_pid"]
            served = processes_under(supervisor)
            names = {open(f"/proc/{p}/cmdline").read().split("\0")[0:3].__str__() for p in served if alive(p)}
            assert len(served) >= 3, names  # the supervisor, vLLM's API server, its engine core (and worker)
            os.kill(trainer.pid, signal.SIGKILL)
            trainer.wait()
            killed = time.monotonic()
            while any(alive(p) for p in served) and time.monotonic() - killed < 20:
                time.sleep(0.1)
            gone_s = time.monotonic() - killed
            assert not [p for p in served if alive(p)], f"left after {gone_s:.1f} s: {names}"
            assert not directory.exists()
            print(f"server and engine processes gone {gone_s:.1f} s after the trainer's SIGKILL")
        finally:
            if trainer.poll() is None:
                trainer.kill()


def test_a_cpu_server_never_splits_a_prefill(tmp_path, monkeypatch):
    """vllm_serve.py on vLLM's CPU build adds whole prefills (vllm.py's whole_prefills: a split
    prefill rewinds a seeded generator, which the CPU cannot) with a step budget of at least one
    context; an explicit setting, or a GPU build, is left alone."""
    from posttrain.rollout import vllm_serve
    from posttrain.rollout.vllm import WHOLE_PREFILL_TOKENS

    assert vllm_serve.WHOLE_PREFILL_TOKENS == WHOLE_PREFILL_TOKENS  # the server's copy of the number
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 16384}))
    monkeypatch.setattr(vllm_serve, "on_cpu_build", lambda: True)
    assert vllm_serve.whole_prefill_arguments(["--model", str(tmp_path)]) == [
        "--no-enable-chunked-prefill", "--max-num-batched-tokens", "16384"]
    assert vllm_serve.whole_prefill_arguments(["--model", str(tmp_path), "--max-model-len", "512"]) == [
        "--no-enable-chunked-prefill", "--max-num-batched-tokens", str(WHOLE_PREFILL_TOKENS)]
    assert vllm_serve.whole_prefill_arguments(["--model", str(tmp_path), "--enable-chunked-prefill"]) == []
    monkeypatch.setattr(vllm_serve, "on_cpu_build", lambda: False)
    assert vllm_serve.whole_prefill_arguments(["--model", str(tmp_path)]) == []
