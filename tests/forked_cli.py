"""`run_command` and `start_command`: `subprocess.run(command, capture_output=True, text=True)`
and `subprocess.Popen(command, stdout=PIPE, stderr=STDOUT, text=True)` for the tests, where a
`python -m posttrain...` command, alone or under `torchrun`, or a `python <script>.py` command
(the benchmarks' workers), runs in processes forked from a server that has already imported
what posttrain imports.

Starting `python -m posttrain.train` spends about 11 s of CPU importing torch, Lightning
(which imports torchmetrics, scipy and matplotlib) and transformers before it reads its first
override. The suite starts such commands dozens of times, so each test process keeps one
server (this file, run as a script) that imports those libraries once and forks a child per
command. The child is a process of its own, as a console script's would be: its own pid,
arguments, environment, working directory, file descriptors 1 and 2 (to files the caller
reads back), signals, exit code and exit handlers; the entry module runs fresh as `__main__`
(`runpy`, as `python -m` does). What it shares with the server is only the imported, unused
libraries. A command whose environment differs from the server's in what those libraries read
at import time runs as a real subprocess instead, as does every other command.

`torchrun --standalone --nproc_per_node=N -m posttrain.train ...` (conftest.TORCHRUN) is
forked as N ranks with the environment torchrun gives its workers, for the tests about what
a job does (pre-emption, resume); the tests about the launcher itself run the real torchrun
with `subprocess`.

A library that ran a parallel OpenMP region before the fork would leave the child hanging on
its first one (GNU OpenMP keeps no threads across fork): the server only imports.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# the entry modules a server forks for (each runs fresh as __main__, so it is not preloaded)
FORKED_MODULES = ("posttrain.train", "posttrain.eval.evaluate", "posttrain.eval.report",
                  "posttrain.eval.sample_dataset")
# the libraries the entry modules import, loaded once by the server
PRELOADED = ("torch", "lightning", "transformers", "transformers.modeling_utils", "hydra", "omegaconf",
             "posttrain.models.loading", "posttrain.algorithms", "posttrain.run.boundary")
# environment variables those libraries read at import time: a command that sets them otherwise
# than the server's environment runs as a real subprocess
IMPORT_TIME_ENVIRONMENT = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TORCH", "PYTORCH", "CUDA", "LD_", "KMP_",
                           "MKL_", "PYTHON")
ALLOWED_TO_DIFFER = ("PYTHONPATH",)  # the child puts its entries at the front of sys.path


def forked_module(command: list[str]) -> tuple[int | None, tuple[str, list[str]] | None]:
    """(ranks, (what to run, its arguments)) if ``command`` is ``python [-u] -m <a FORKED_MODULES
    entry> ...`` or ``python [-u] <a script>.py ...`` (ranks None), or such a module under
    ``python -m torch.distributed.run --standalone --nproc_per_node=N`` (conftest.TORCHRUN);
    (None, None) for any other command. A script is named by its path."""
    if not command or command[0] != sys.executable:
        return None, None
    rest = command[2:] if command[1:2] == ["-u"] else command[1:]  # -u: the child flushes at exit anyway
    if rest and rest[0].endswith(".py") and Path(rest[0]).is_file():
        return None, (str(Path(rest[0]).resolve()), rest[1:])
    world = None
    if rest[:3] == ["-m", "torch.distributed.run", "--standalone"] and rest[3:4] and \
            rest[3].startswith("--nproc_per_node="):
        world, rest = int(rest[3].split("=", 1)[1]), rest[4:]
    if len(rest) >= 2 and rest[0] == "-m" and rest[1] in FORKED_MODULES:
        return world, (rest[1], rest[2:])
    return None, None


def _same_import_time_environment(env: dict, server_env: dict) -> bool:
    def relevant(e):
        return {k: v for k, v in e.items() if k.startswith(IMPORT_TIME_ENVIRONMENT) and k not in ALLOWED_TO_DIFFER}

    return relevant(env) == relevant(server_env)


class ForkServer:
    """One server process per test process, started at its first command. Its requests never
    block: it forks a command and answers its pid, or says whether a child it forked has ended."""

    def __init__(self):
        self.process = None
        self.env = None

    def start(self) -> None:
        self.env = dict(os.environ)
        self.process = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True, env=self.env)
        assert self.process.stdout.readline().strip() == "ready", "the fork server did not start"

    def started(self) -> ForkServer:
        if self.process is None or self.process.poll() is not None:
            self.start()
        return self

    def ask(self, **request) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())


SERVER = ForkServer()


class ForkedProcess:
    """What `subprocess.Popen(command, stdout=PIPE, stderr=STDOUT, text=True)` returns, for a
    command forked from the server: `pid`, `returncode`, `poll`, `wait`, `send_signal`, `kill`
    and `communicate` (stdout and stderr together, read from a file once the process ended)."""

    def __init__(self, target: str, arguments: list[str], env: dict, cwd, *, merged: bool = True):
        self.scratch = tempfile.TemporaryDirectory()
        self.stdout = Path(self.scratch.name) / "stdout"
        self.stderr = self.stdout if merged else Path(self.scratch.name) / "stderr"
        self.returncode = None
        self.pid = SERVER.ask(op="start", target=target, arguments=arguments, env=env, cwd=str(cwd or os.getcwd()),
                              stdout=str(self.stdout), stderr=str(self.stderr))["pid"]

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = SERVER.ask(op="poll", pid=self.pid)["returncode"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def read_output(self, path: Path | None = None) -> str:
        path = path or self.stdout
        return path.read_text(errors="replace") if path.exists() else ""

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        self.wait(timeout)
        return self.read_output(), None


class ForkedJob:
    """`torchrun --standalone --nproc_per_node=N -m <module> ...` as the tests use it, forked
    from the server: one process per rank with the environment torchrun gives its workers
    (ranks, world size, a rendezvous address, TORCHELASTIC_RUN_ID), Popen's handle for all of
    them. As torchrun does, it ends the other ranks when one fails and exits 1; `pid` is rank 0's."""

    def __init__(self, world: int, target: str, arguments: list[str], env: dict, cwd):
        port, run_id = free_port(), f"forked-{os.getpid()}-{time.monotonic_ns()}"
        self.ranks = [ForkedProcess(target, arguments, {
            **env, "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
            "ROLE_NAME": "default", "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
            "ROLE_WORLD_SIZE": str(world), "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0", "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1")}, cwd)
            for rank in range(world)]
        self.pid = self.ranks[0].pid
        self.returncode = None

    def poll(self) -> int | None:
        codes = [rank.poll() for rank in self.ranks]
        if any(code not in (None, 0) for code in codes):
            for rank in self.ranks:
                rank.kill()
            for rank in self.ranks:
                rank.wait()
            self.returncode = 1
        elif all(code == 0 for code in codes):
            self.returncode = 0
        return self.returncode

    wait = ForkedProcess.wait

    def send_signal(self, signum: int) -> None:
        for rank in self.ranks:
            rank.send_signal(signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def read_output(self) -> str:
        return "".join(f"[rank {i}]\n{rank.read_output()}" for i, rank in enumerate(self.ranks))

    communicate = ForkedProcess.communicate


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fork_plan(command: list[str], env: dict | None) -> tuple[int | None, tuple[str, list[str]] | None, dict]:
    """(ranks, what to run, the child's environment) as `forked_module` gives them, with what to
    run None where ``command`` must run as a real subprocess: not a forked entry, or an
    environment that differs from the server's in what the preloaded libraries read at import."""
    environment = dict(os.environ if env is None else env)
    world, entry = forked_module(command)
    if entry is not None and not _same_import_time_environment(environment, SERVER.started().env):
        entry = None
    return world, entry, environment


def start_command(command: list[str], *, env: dict | None = None, cwd=None) -> subprocess.Popen | ForkedProcess:
    """``subprocess.Popen(command, stdout=PIPE, stderr=STDOUT, text=True, env=env, cwd=cwd)``;
    forked from the server where ``command`` runs a posttrain entry module, alone or under
    `torchrun --standalone --nproc_per_node=N` (see the module docstring)."""
    command = [str(c) for c in command]
    world, entry, environment = _fork_plan(command, env)
    if entry is None:
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                cwd=cwd)
    if world is None:
        return ForkedProcess(*entry, environment, cwd)
    return ForkedJob(world, *entry, environment, cwd)


def run_command(command: list[str], *, env: dict | None = None, cwd=None, timeout: float | None = None,
                **options) -> subprocess.CompletedProcess:
    """``subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)``;
    forked from the server where ``command`` runs a posttrain entry module (see the module docstring)."""
    if options.pop("capture_output", True) is not True or options.pop("text", True) is not True:
        raise ValueError("run_command always captures the output as text")
    command = [str(c) for c in command]
    world, entry, environment = _fork_plan(command, env)
    if entry is None or world is not None or options:
        return subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout, **options)
    process = ForkedProcess(*entry, environment, cwd, merged=False)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise subprocess.TimeoutExpired(command, timeout, output=process.read_output(),
                                        stderr=process.read_output(process.stderr)) from None
    return subprocess.CompletedProcess(command, process.returncode, process.read_output(),
                                       process.read_output(process.stderr))


# --- the server ----------------------------------------------------------------------------------
def _child(request: dict) -> None:
    """Run one command in this forked process, then exit with its code (never returns)."""
    code = 1
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.path[0] = request["cwd"]  # `python -m` puts the working directory first (the server: tests/)
        for entry in reversed([p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]):
            if entry not in sys.path:  # the server's own PYTHONPATH entries are there already
                sys.path.insert(1, entry)
        stdin = os.open(os.devnull, os.O_RDONLY)
        out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        err = out if request["stderr"] == request["stdout"] else \
            os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(stdin, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        threads = request["env"].get("OMP_NUM_THREADS")
        if threads:
            import torch

            torch.set_num_threads(int(threads))

        target = request["target"]  # an entry module, or a script's path
        try:
            if target.endswith(".py"):  # `python script.py`: its folder first on the path
                sys.argv, sys.path[0] = [target, *request["arguments"]], os.path.dirname(target)
                runpy.run_path(target, run_name="__main__")
            else:
                sys.argv = [importlib.util.find_spec(target).origin, *request["arguments"]]
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as stop:
            if stop.code is None or isinstance(stop.code, int):
                code = stop.code or 0
            else:
                print(stop.code, file=sys.stderr)
                code = 1
    except BaseException:  # noqa: BLE001 - an uncaught error, as the interpreter would print it
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:
            import atexit

            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve() -> None:
    """Requests, a JSON line each: `start` forks a command and answers its pid; `poll` answers
    the exit code of a child started here (as subprocess gives it: -N for a signal), or null
    while it runs."""
    for name in PRELOADED:
        importlib.import_module(name)
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "start":
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(request)
            reply = dict(pid=pid)
        else:
            done, status = os.waitpid(request["pid"], os.WNOHANG)
            reply = dict(returncode=os.waitstatus_to_exitcode(status) if done else None)
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    serve()
