"""`rollout=vllm_server`: generation by a vLLM OpenAI-compatible server in its own process.

posttrain starts the server (or, with `rollout.url`, connects to one already running), samples
through `/v1/completions` with token ids in (a prompt may be a list of ids) and token ids and
log-probs out (`return_token_ids`, `logprobs=0`), and pushes the policy's weights to it before
it samples with weights the server does not hold. Nothing here imports vLLM: the server runs
in `rollout.server_python` (a venv with vLLM; null: $POSTTRAIN_VLLM_PYTHON, else this
interpreter), the trainer needs only the standard library to talk to it.

The server
----------
Built from the policy at the first `generate`: its config.json is exported to a directory
(as rollout=vllm does), vLLM starts on random ("dummy") weights with `--skip-tokenizer-init`
(token ids only) and `--generation-config vllm` (no sampling defaults from the model's files),
and the policy's weights are pushed before anything is sampled, so the warm-started, resumed
or LoRA-merged policy is what samples. It runs under a supervisor (vllm_serve.py, copied next
to the config) in a process group of its own; the supervisor stops the group (vLLM's engine
core and worker included) when the trainer exits, crashes or is killed with SIGKILL
(PR_SET_PDEATHSIG, and a watch on its parent's pid). An engine `close`d, or the process
exiting, stops the server it started.

Which engines share a server: one per job on a host. The engines of one process (the
trainer's, and the copy a producer process gets) and the ranks of a ddp/fsdp job on one host
meet in one directory under /dev/shm named after the job (the trainer's pid; under several
ranks MASTER_ADDR and MASTER_PORT); the first engine that needs the server starts it under a
file lock, the others connect to the URL it writes there. `rollout.url` names a server
started by hand (vllm_serve.py's docstring says how); it must run on the same host, since the
weights travel as files.

Weights and versions
--------------------
An engine names the weights it samples with by a fingerprint (a CRC-32 of each tensor's
bytes), taken again after `policy_updated()`. The
server holds one set of weights, tagged with the fingerprint of the push that loaded them.
Every generation holds a shared file lock while it samples and checks that the server's tag
is its own; if not, it takes the lock exclusively and pushes: the weights are written (in the
server's dtype, tied tensors once) as a safetensors file under /dev/shm, the server loads it
in place (`/collective_rpc` -> the worker extension's `posttrain_load_weights`, which calls
vLLM's `reload_weights(weights_iterator=..., is_checkpoint_format=True)`), the file is
deleted and the prefix cache reset (`/reset_prefix_cache`: cached keys and values of the old
weights). So a request is only ever sampled by the weights of the engine that sent it: the
version the collector stamps on each token (`rollout.max_staleness`) and the log-probs the
corrections compare (`rollout.correction`) are the same as with the other engines. Ranks with
the same weights (ddp, fsdp) have the same fingerprint: the first to see the server behind
pushes, the others find it current and sample at once, each rank with its own requests;
nothing here is a collective, so no rank waits on another's. Engines with different weights
(a producer process a version ahead of the trainer's held-out evaluation) take turns, pushing
each time.

Under fsdp the engine is called inside `full_weights` (GatheringEngine), where every rank has
the whole policy: a push reads plain tensors. The transport is `push_weights`; a NCCL
broadcast from the trainer's GPU to the server's (vLLM's weight-transfer engines) would
replace the file there and keep the protocol above. It is not written and not tested here.

Log-probs follow rollout=vllm (vllm.py): `--logprobs-mode` is `processed_logprobs` without a
top-k/top-p filter (posttrain's log_softmax(logits / T) at any temperature), `raw_logprobs`
with one (then T must be 1), and a call the mode cannot serve gets NaN log-probs.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator, Optional, Sequence

import torch
from torch import nn

from posttrain.distributed.collectives import rank_and_world
from posttrain.errors import ConfigError
from posttrain.models.loading import DTYPES

from .base import RolloutBatch, SamplingParams, check_prompts, eos_tensor
from .vllm_serve import set_parent_death_signal
from .vllm import (MAX_REQUEST_SEED, export_model_config, logprobs_mode_for, plain_policy, prompt_token_lists,
                   reports_posttrain_logprobs, rollout_from_outputs)

log = logging.getLogger(__name__)

SERVE_SCRIPT = Path(__file__).with_name("vllm_serve.py")
SERVE_MODULE = "posttrain_vllm_serve"  # the name the server imports the worker extension under
SERVED_MODEL = "policy"  # --served-model-name
PYTHON_ENV = "POSTTRAIN_VLLM_PYTHON"  # the server's interpreter when rollout.server_python is null
STOP_TIMEOUT_S = 15.0
HTTP_TIMEOUT_S = 3600.0  # one request: a long generation on a slow CPU
MAX_CONCURRENT_REQUESTS = 64
# How many log lines of a server that failed to start go into the error.
LOG_TAIL_LINES = 25


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class ServerSettings:
    """How to start the server (the `rollout` keys of the same names)."""

    python: str
    host: str
    port: Optional[int]
    dtype: str
    max_model_len: Optional[int]
    kv_cache_gib: float
    max_num_seqs: int
    enforce_eager: bool
    startup_timeout_s: float
    env: tuple  # ((name, value), ...): extra environment of the server
    logprobs_mode: str

    def arguments(self, model_dir: Path, port: int) -> list[str]:
        """vLLM's command-line arguments."""
        args = ["--model", str(model_dir), "--served-model-name", SERVED_MODEL, "--skip-tokenizer-init",
                "--load-format", "dummy", "--generation-config", "vllm", "--logprobs-mode", self.logprobs_mode,
                "--dtype", self.dtype, "--host", self.host, "--port", str(port),
                "--worker-extension-cls", f"{SERVE_MODULE}.PosttrainWeights",
                "--kv-cache-memory-bytes", str(int(self.kv_cache_gib * 2**30)),
                "--max-num-seqs", str(self.max_num_seqs), "--seed", "0", "--uvicorn-log-level", "warning"]
        if self.max_model_len is not None:
            args += ["--max-model-len", str(self.max_model_len)]
        if self.enforce_eager:
            args.append("--enforce-eager")
        return args


def default_python() -> str:
    return os.environ.get(PYTHON_ENV) or sys.executable


def shared_root() -> Path:
    """Where the servers' directories go: /dev/shm (memory) where it exists."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(os.environ.get("TMPDIR", "/tmp"))


def job_key() -> str:
    """The name every engine of this job on this host computes alike: the process's pid, or,
    under several ranks, the rendezvous address they share."""
    world = rank_and_world()[1]
    if world > 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        address = f"{os.environ.get('MASTER_ADDR', 'local')}-{os.environ.get('MASTER_PORT', '0')}"
        return "ddp-" + "".join(c if c.isalnum() or c in "-." else "_" for c in address)
    return f"pid{os.getpid()}"


def url_key(url: str) -> str:
    return "url-" + hashlib.sha1(url.encode()).hexdigest()[:12]


def port_taken(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- weights


def served_weights(model: nn.Module, dtype: Optional[torch.dtype]) -> dict[str, torch.Tensor]:
    """The policy's weights as the server loads them: Hugging Face names (a LoRA policy merged),
    on the CPU, contiguous, in `dtype` (None: their own), each storage once (tied embeddings:
    the first name)."""
    weights, seen = {}, set()
    for name, tensor in plain_policy(model).state_dict().items():
        if type(tensor) is not torch.Tensor and hasattr(tensor, "full_tensor"):
            raise RuntimeError(f"rollout=vllm_server: {name} is sharded (a DTensor); the engine pushes whole "
                               f"weights, which generation under trainer=fsdp gathers (GatheringEngine)")
        tensor = tensor.detach()
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        tensor = tensor.to("cpu", dtype=dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype)
        weights[name] = tensor.contiguous()
    return weights


def fingerprint(weights: dict[str, torch.Tensor]) -> str:
    """A short name for a set of weights: per tensor, its name, shape and dtype and a CRC-32 of
    its bytes (0.12 s for SmolLM2-135M's 540 MB on one core; a float64 sum and sum of squares
    took 2.5-4 s)."""
    digest = hashlib.sha1()
    for name, tensor in weights.items():
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}{zlib.crc32(data)}".encode())
    return digest.hexdigest()[:20]


def write_safetensors(weights: dict[str, torch.Tensor], path: Path) -> None:
    # optional: safetensors comes with transformers; imported where weights are written
    from safetensors.torch import save_file

    tmp = path.with_suffix(".partial")
    save_file(weights, str(tmp))
    os.replace(tmp, path)


# --------------------------------------------------------------------------- the server


@contextlib.contextmanager
def file_lock(path: Path, exclusive: bool) -> Iterator[int]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield fd
    finally:
        os.close(fd)  # releases the lock


class VLLMServer:
    """One server as the engines of this process see it: its URL and directory, and, when
    this process started it, its supervisor process (`owner`)."""

    def __init__(self, url: str, directory: Path, settings_key: str, process: Optional[subprocess.Popen] = None):
        self.url = url.rstrip("/")
        self.directory = directory
        self.settings_key = settings_key
        self.process = process
        self.pushes = 0  # weight pushes made by this process
        self.push_seconds: list[float] = []  # each push: write + load + cache reset

    @property
    def owner(self) -> bool:
        return self.process is not None

    # --- HTTP ----------------------------------------------------------------------------------
    def post(self, path: str, body: Optional[dict] = None, timeout: float = HTTP_TIMEOUT_S):
        data = json.dumps(body or {}).encode()
        request = urllib.request.Request(f"{self.url}{path}", data=data, method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:2000]
            raise RuntimeError(f"rollout=vllm_server: {path} answered {err.code}: {detail}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as err:
            raise RuntimeError(f"rollout=vllm_server: the server at {self.url} did not answer {path} ({err})"
                               f"{self.log_tail()}") from None
        return json.loads(raw) if raw else None

    def healthy(self, timeout: float = 2.0) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=timeout) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def rpc(self, method: str, *args: str):
        """One call on the server's worker (the dev endpoint /collective_rpc): its result."""
        answer = self.post("/collective_rpc", {"method": method, "args": [str(a) for a in args]})
        return answer["results"][0]

    def log_tail(self) -> str:
        log_file = self.directory / "server.log"
        if not log_file.exists():
            return ""
        lines = log_file.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        return "\n  the server's last log lines:\n    " + "\n    ".join(lines) if lines else ""

    # --- weights -------------------------------------------------------------------------------
    @property
    def tag_file(self) -> Path:
        return self.directory / "weights.tag"

    def current_tag(self) -> str:
        try:
            return self.tag_file.read_text()
        except FileNotFoundError:
            return ""

    def weights(self) -> dict:
        """What the server itself says it holds: {"tag": ..., "loads": ...}."""
        return self.rpc("posttrain_weights")

    def push_weights(self, weights: dict[str, torch.Tensor], tag: str) -> None:
        """Hand `weights` to the server (call under the exclusive lock). The transport: a
        safetensors file in this directory (shared memory), loaded in place by the server's
        worker; a NCCL broadcast would go here on GPUs (not written)."""
        started = time.perf_counter()
        folder = self.directory / "weights"
        folder.mkdir(exist_ok=True)
        path = folder / f"push-{os.getpid()}.safetensors"
        self.tag_file.unlink(missing_ok=True)  # a push that fails half-way leaves no tag
        try:
            write_safetensors(weights, path)
            answer = self.rpc("posttrain_load_weights", str(path), tag)
        finally:
            path.unlink(missing_ok=True)
        if answer.get("tag") != tag:
            raise RuntimeError(f"rollout=vllm_server: the server loaded weights {answer}, expected tag {tag}")
        self.post("/reset_prefix_cache")  # cached keys and values were computed by the old weights
        tmp = self.tag_file.with_suffix(".partial")
        tmp.write_text(tag)
        os.replace(tmp, self.tag_file)
        self.pushes += 1
        self.push_seconds.append(time.perf_counter() - started)

    @contextlib.contextmanager
    def sampling_with(self, tag: str, weights_of) -> Iterator[None]:
        """Inside, the server holds the weights tagged `tag` and no other engine may push:
        a shared lock while sampling, the exclusive lock to push `weights_of()` first if the
        server holds other weights."""
        lock = self.directory / "weights.lock"
        while True:
            with file_lock(lock, exclusive=False):
                if self.current_tag() == tag:
                    yield
                    return
            with file_lock(lock, exclusive=True):
                if self.current_tag() != tag:
                    self.push_weights(weights_of(), tag)
            # then sample under the shared lock; another engine may push in between: look again

    # --- life ------------------------------------------------------------------------------------
    def alive(self) -> bool:
        return self.process is None or self.process.poll() is None

    def stop(self) -> None:
        """Stop the server this process started (its supervisor takes the group down) and
        remove its directory; nothing for a server started elsewhere."""
        if self.process is None:
            return
        process, self.process = self.process, None
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()  # the server gets SIGTERM through its own parent-death signal
                process.wait()
        shutil.rmtree(self.directory, ignore_errors=True)
        if _SERVERS.get(self.directory.name) is self:
            del _SERVERS[self.directory.name]


# The servers this process knows, by directory name (one per job, or per URL).
_SERVERS: dict[str, VLLMServer] = {}


@atexit.register
def _stop_servers() -> None:
    for server in list(_SERVERS.values()):
        server.stop()


def start_server(settings: ServerSettings, model: nn.Module, directory: Path, settings_key: str) -> VLLMServer:
    """Start a server for `model` in `directory` and wait until it answers (ConfigError naming
    the key at fault when it cannot start)."""
    python = settings.python
    if not (os.path.isfile(python) and os.access(python, os.X_OK)) and shutil.which(python) is None:
        raise ConfigError(f"rollout.server_python={python!r} is not an executable: point it at the python of an "
                          f"environment with vLLM (e.g. a venv's bin/python), or null for ${PYTHON_ENV}, else this "
                          f"interpreter")
    if settings.port is not None and port_taken(settings.host, settings.port):
        raise ConfigError(f"rollout.port={settings.port} is taken on {settings.host}: choose a free port, or null to "
                          f"pick one")
    port = settings.port if settings.port is not None else free_port(settings.host)
    for stale in ("weights.tag", "server.json"):
        (directory / stale).unlink(missing_ok=True)
    model_dir = directory / "model"
    model_dir.mkdir(exist_ok=True)
    # the config of the model whose weights are pushed: a LoRA policy merged (a LoRA-adapted
    # tied head comes out untied, tie_word_embeddings=false: models/lora.py:merged_copy)
    export_model_config(plain_policy(model), str(model_dir))
    shutil.copyfile(SERVE_SCRIPT, directory / f"{SERVE_MODULE}.py")
    env = dict(os.environ)
    env.update({"VLLM_SERVER_DEV_MODE": "1", "PYTHONUNBUFFERED": "1"})
    env.update(dict(settings.env))
    command = [python, str(directory / f"{SERVE_MODULE}.py"), "--parent-pid", str(os.getpid()),
               "--cleanup", str(directory), "--", *settings.arguments(model_dir, port)]
    in_main_thread = threading.current_thread() is threading.main_thread()
    with open(directory / "server.log", "w") as log_file:
        try:
            process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                       env=env, start_new_session=True,
                                       # the supervisor is told at once when this thread's process dies
                                       preexec_fn=_parent_death_signal if in_main_thread else None)
        except OSError as err:
            raise ConfigError(f"rollout.server_python={python!r} cannot be started: {err}") from None
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
    server = VLLMServer(f"http://{host}:{port}", directory, settings_key, process)
    started = time.monotonic()
    while not server.healthy(timeout=2.0):
        code = process.poll()
        if code is not None:
            tail = server.log_tail()
            server.process = None
            shutil.rmtree(directory, ignore_errors=True)  # what it logged is in the message
            key = "rollout.port" if "address already in use" in tail.lower() else "rollout.server_python"
            raise ConfigError(f"rollout=vllm_server: the vLLM server exited with code {code} before it answered; "
                              f"check {key}={python if key.endswith('python') else port!r} (it must be the python "
                              f"of an environment with vLLM) and the other rollout.* server settings{tail}")
        if time.monotonic() - started > settings.startup_timeout_s:
            tail = server.log_tail()
            server.stop()
            raise ConfigError(f"rollout=vllm_server: the vLLM server did not answer within "
                              f"rollout.startup_timeout_s={settings.startup_timeout_s:g} s{tail}")
        time.sleep(0.5)
    log.info("rollout=vllm_server: vLLM serves at %s (started in %.0f s, log %s)", server.url,
             time.monotonic() - started, directory / "server.log")
    (directory / "server.json").write_text(json.dumps({"url": server.url, "settings": settings_key,
                                                       "supervisor_pid": process.pid}))
    return server


def _parent_death_signal() -> None:
    set_parent_death_signal(signal.SIGTERM)


# --------------------------------------------------------------------------- the engine


class VLLMServerEngine:
    """A RolloutEngine backed by a vLLM server in another process (see the module docstring).

    Args (the `rollout` keys of the same names, conf/rollout/vllm_server.yaml):
    url: a running server to use (started by vllm_serve.py, on this host); null: start one.
    server_python: the server's interpreter; null: $POSTTRAIN_VLLM_PYTHON, else this one.
    host, port: where a started server listens; port null: a free one.
    dtype: the server's weights and compute dtype; auto: the policy's.
    max_model_len: prompt + response tokens per sequence; null: the model's context.
    kv_cache_gib: the server's KV cache (on the CPU, host memory).
    max_num_seqs: sequences the server decodes at once.
    enforce_eager: no torch.compile / CUDA graphs (starts faster).
    startup_timeout_s: how long to wait for a started server to answer.
    server_env: extra environment variables of the server (e.g. VLLM_CPU_OMP_THREADS_BIND).
    temperature, top_k, top_p: the configured sampling, which fixes vLLM's logprobs_mode.
    """

    config_keys = ("url", "server_python", "host", "port", "dtype", "max_model_len", "kv_cache_gib", "max_num_seqs",
                   "enforce_eager", "startup_timeout_s", "server_env", "temperature", "top_k", "top_p")

    def __init__(self, url: Optional[str] = None, server_python: Optional[str] = None, host: str = "127.0.0.1",
                 port: Optional[int] = None, dtype: str = "auto", max_model_len: Optional[int] = None,
                 kv_cache_gib: float = 1.0, max_num_seqs: int = 256, enforce_eager: bool = True,
                 startup_timeout_s: float = 600.0, server_env: Optional[dict] = None, temperature: float = 1.0,
                 top_k: int = 0, top_p: float = 1.0):
        self.url = url
        self.server_python = server_python
        self.host, self.port = host, port
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.kv_cache_gib = float(kv_cache_gib)
        self.max_num_seqs = int(max_num_seqs)
        self.enforce_eager = bool(enforce_eager)
        self.startup_timeout_s = float(startup_timeout_s)
        self.server_env = {str(k): str(v) for k, v in dict(server_env or {}).items()}
        self.logprobs_mode = logprobs_mode_for(temperature, top_k, top_p)
        self.key: Optional[str] = None  # the server's directory name, fixed at first use
        self.tag: Optional[str] = None  # the fingerprint of the weights this engine samples with
        self.weight_syncs = 0  # pushes this engine made (tests, logs)
        self._server: Optional[VLLMServer] = None
        self._pool: Optional[ThreadPoolExecutor] = None
        self._warned_nan = False

    @property
    def sync_seconds(self) -> float:
        """The seconds the pushes to this engine's server took, in all (logs, benchmarks), as
        rollout=vllm's attribute of the same name: each push's write, load and cache reset."""
        return sum(self._server.push_seconds) if self._server is not None else 0.0

    # --- the hook ---------------------------------------------------------------------------------
    def policy_updated(self) -> None:
        """The policy's weights changed: fingerprint them again at the next generation."""
        self.tag = None

    # --- a copy for a producer process ---------------------------------------------------------
    def __getstate__(self) -> dict:
        """A copy in another process (a producer) finds the same server: the job's key is fixed
        here, in the trainer; the server handle and the thread pool stay behind."""
        self._key()
        state = dict(self.__dict__)
        state.update(_server=None, _pool=None)
        return state

    # --- RolloutEngine ------------------------------------------------------------------------------
    def generate(
        self,
        model: nn.Module,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        params: SamplingParams,
        eos_token_id: int | Sequence[int],
        pad_token_id: int,
        generator: Optional[torch.Generator] = None,
    ) -> RolloutBatch:
        params.validate()
        check_prompts(prompt_ids, prompt_mask)
        if params.return_support:
            raise ValueError("rollout=vllm_server does not report the kept top-k/top-p support (return_support, "
                             "algorithm.keep_sampling_mask); use rollout=fast or hf")
        eos = eos_tensor(eos_token_id, prompt_ids.device)
        prompts = prompt_token_lists(prompt_ids, prompt_mask)
        if self.max_model_len is not None:
            longest = max(len(p) for p in prompts)
            if longest + params.max_new_tokens > self.max_model_len:
                raise ConfigError(f"rollout.max_model_len={self.max_model_len} is below the longest prompt ({longest} "
                                  f"tokens) + the generation budget ({params.max_new_tokens}); raise it or set it to "
                                  f"null (the model's context)")
        with_logprobs = self._logprobs_expressible(params)
        bodies = self._request_bodies(prompts, params, eos.tolist(), generator)
        server = self.server(model)
        weights = None
        if self.tag is None:
            weights = self._weights(model)
            self.tag = fingerprint(weights)

        def weights_of():
            self.weight_syncs += 1
            return weights if weights is not None else self._weights(model)

        with server.sampling_with(self.tag, weights_of):
            weights = None  # pushed or not needed: free it before sampling
            answers = list(self._executor().map(self._complete, bodies))
        outputs = [SimpleNamespace(outputs=[SimpleNamespace(
            token_ids=a["token_ids"], finish_reason=a["finish_reason"],
            logprobs=[{token: SimpleNamespace(logprob=lp)} for token, lp in zip(a["token_ids"], a["logprobs"])],
        )]) for a in answers]
        return rollout_from_outputs(outputs, prompt_ids, prompt_mask, params.max_new_tokens, eos, pad_token_id,
                                    with_logprobs, params.repetition)

    def close(self) -> None:
        """Stop the server if this process started it; a later `generate` starts another."""
        if self._server is not None:
            self._server.stop()
            self._server = None
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    # --- the server ---------------------------------------------------------------------------------
    def _key(self) -> str:
        if self.key is None:
            self.key = url_key(self.url) if self.url else job_key()
        return self.key

    def settings(self, model: nn.Module) -> ServerSettings:
        dtype = self.dtype if self.dtype != "auto" else str(next(model.parameters()).dtype).removeprefix("torch.")
        return ServerSettings(python=self.server_python or default_python(), host=self.host, port=self.port,
                              dtype=dtype, max_model_len=self.max_model_len, kv_cache_gib=self.kv_cache_gib,
                              max_num_seqs=self.max_num_seqs, enforce_eager=self.enforce_eager,
                              startup_timeout_s=self.startup_timeout_s, env=tuple(sorted(self.server_env.items())),
                              logprobs_mode=self.logprobs_mode)

    def server(self, model: nn.Module) -> VLLMServer:
        """The server this engine samples through: this process's, the job's (started by another
        engine or rank), or a new one, started here."""
        if self._server is not None and self._server.alive():
            return self._server
        key = self._key()
        directory = shared_root() / f"posttrain-vllm-{key}"
        if self.url:
            directory.mkdir(exist_ok=True)
            server = _SERVERS.get(key) or VLLMServer(self.url, directory, "url")
            if not server.healthy(timeout=10.0):
                raise ConfigError(f"rollout.url={self.url!r}: no vLLM server answers there (GET /health); start one "
                                  f"with src/posttrain/rollout/vllm_serve.py, or set rollout.url=null to start one")
            self._server = _SERVERS[key] = server
            return server
        settings = self.settings(model)
        config = model.config.to_json_string() if hasattr(model, "config") else ""
        settings_key = hashlib.sha1(f"{settings}{config}".encode()).hexdigest()[:12]
        known = _SERVERS.get(key)
        if known is not None and known.alive() and known.settings_key == settings_key and known.healthy():
            self._server = known
            return known
        if known is not None:
            known.stop()  # another model or other settings: one server at a time
        # one server per job, whoever starts it
        for other in [name for name, s in _SERVERS.items() if s.owner and name != key]:
            _SERVERS[other].stop()
        directory.mkdir(exist_ok=True)
        with file_lock(directory / "start.lock", exclusive=True):
            server = self._running(directory, settings_key)
            if server is None:
                try:
                    server = start_server(settings, model, directory, settings_key)
                except BaseException:
                    shutil.rmtree(directory, ignore_errors=True)  # its log is in the error
                    raise
        self._server = _SERVERS[key] = server
        return server

    @staticmethod
    def _running(directory: Path, settings_key: str) -> Optional[VLLMServer]:
        """The job's server another process started, if it is up."""
        try:
            info = json.loads((directory / "server.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        server = VLLMServer(info["url"], directory, info["settings"])
        if info["settings"] != settings_key:
            log.warning("rollout=vllm_server: the job's server at %s was started with other settings", server.url)
        return server if server.healthy() else None

    def _weights(self, model: nn.Module) -> dict[str, torch.Tensor]:
        dtype = None if self.dtype == "auto" else DTYPES[self.dtype]
        return served_weights(model, dtype)

    # --- requests -------------------------------------------------------------------------------------
    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=MAX_CONCURRENT_REQUESTS, thread_name_prefix="vllm-request")
        return self._pool

    def _request_bodies(self, prompts: list[list[int]], params: SamplingParams, eos_ids: list[int],
                        generator: Optional[torch.Generator]) -> list[dict]:
        """One /v1/completions body per row. A request of many prompts shares one seed, so
        each row is its own request; with a generator, its seed is drawn from it, so a run
        repeats from its seed."""
        if params.greedy:
            sampling = dict(temperature=0.0)
        else:
            sampling = dict(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
        common = dict(model=SERVED_MODEL, max_tokens=params.max_new_tokens, logprobs=0, return_token_ids=True,
                      return_tokens_as_token_ids=True, stop_token_ids=list(eos_ids), **sampling)
        seeds = [None] * len(prompts)
        if generator is not None and not params.greedy:
            first = int(torch.randint(0, MAX_REQUEST_SEED - len(prompts), (1,), generator=generator,
                                      device=generator.device))
            seeds = [first + row for row in range(len(prompts))]
        return [dict(common, prompt=prompt, **({} if seed is None else {"seed": seed}))
                for prompt, seed in zip(prompts, seeds)]

    def _complete(self, body: dict) -> dict:
        answer = self._server.post("/v1/completions", body)
        choice = answer["choices"][0]
        logprobs = choice.get("logprobs") or {}
        return {"token_ids": list(choice["token_ids"] or []), "finish_reason": choice["finish_reason"],
                "logprobs": [float("nan") if lp is None else lp for lp in logprobs.get("token_logprobs") or []]}

    def _logprobs_expressible(self, params: SamplingParams) -> bool:
        expressible = reports_posttrain_logprobs(self.logprobs_mode, params)
        if not expressible and not self._warned_nan:
            self._warned_nan = True
            log.warning("rollout=vllm_server: log-probs of a call at temperature=%s, top_k=%s, top_p=%s are not in "
                        "posttrain's convention under logprobs_mode=%s; they are NaN (tokens are unaffected)",
                        params.temperature, params.top_k, params.top_p, self.logprobs_mode)
        return expressible
