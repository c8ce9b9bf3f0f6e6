"""`run_command`: `subprocess.run(command, capture_output=True, text=True, ...)` for the tests,
where a `python -m posttrain...` command runs in a process forked from a server that has
already imported what posttrain imports.

Starting `python -m posttrain.train` spends about 11 s of CPU importing torch, Lightning
(which imports torchmetrics, scipy and matplotlib) and transformers before it reads its first
override. The suite starts such commands dozens of times, so each test process keeps one
server (this file, run as a script) that imports those libraries once and forks a child per
command. The child is a process of its own, as a console script's would be: its own pid,
arguments, environment, working directory, file descriptors 1 and 2 (to files the caller
reads back), exit code and exit handlers; the entry module runs fresh as `__main__`
(`runpy`, as `python -m` does). What it shares with the server is only the imported,
unused libraries. A command whose environment differs from the server's in what those
libraries read at import time runs as a real subprocess instead, as does every other command.

A library that ran a parallel OpenMP region before the fork would leave the child hanging on
its first one (GNU OpenMP keeps no threads across fork): the server only imports.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import runpy
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# the entry modules a server forks for (each runs fresh as __main__, so it is not preloaded)
FORKED_MODULES = ("posttrain.train", "posttrain.eval.evaluate", "posttrain.eval.report")
# the libraries the entry modules import, loaded once by the server
PRELOADED = ("torch", "lightning", "transformers", "transformers.modeling_utils", "hydra", "omegaconf",
             "posttrain.models.loading", "posttrain.algorithms", "posttrain.run.boundary")
# environment variables those libraries read at import time: a command that sets them otherwise
# than the server's environment runs as a real subprocess
IMPORT_TIME_ENVIRONMENT = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TORCH", "PYTORCH", "CUDA", "LD_", "KMP_",
                           "MKL_", "PYTHON")
ALLOWED_TO_DIFFER = ("PYTHONPATH",)  # the child puts its entries at the front of sys.path


def forked_module(command: list[str]) -> tuple[str, list[str]] | None:
    """(entry module, its arguments) if ``command`` is ``python [-u] -m <a FORKED_MODULES entry> ...``."""
    if not command or command[0] != sys.executable:
        return None
    rest = command[2:] if command[1:2] == ["-u"] else command[1:]  # -u: the child flushes at exit anyway
    if len(rest) >= 2 and rest[0] == "-m" and rest[1] in FORKED_MODULES:
        return rest[1], rest[2:]
    return None


def _same_import_time_environment(env: dict, server_env: dict) -> bool:
    def relevant(e):
        return {k: v for k, v in e.items() if k.startswith(IMPORT_TIME_ENVIRONMENT) and k not in ALLOWED_TO_DIFFER}

    return relevant(env) == relevant(server_env)


class ForkServer:
    """One server process per test process, started at its first command."""

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

    def run(self, module, arguments, env, cwd, timeout) -> tuple[int, str, str, bool]:
        with tempfile.TemporaryDirectory() as scratch:
            out, err = Path(scratch) / "stdout", Path(scratch) / "stderr"
            request = dict(module=module, arguments=arguments, env=env, cwd=str(cwd or os.getcwd()),
                           stdout=str(out), stderr=str(err), timeout=timeout)
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            reply = json.loads(self.process.stdout.readline())
            return reply["returncode"], out.read_text(errors="replace"), err.read_text(errors="replace"), \
                reply["timed_out"]


SERVER = ForkServer()


def run_command(command: list[str], *, env: dict | None = None, cwd=None, timeout: float | None = None,
                **options) -> subprocess.CompletedProcess:
    """``subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)``;
    forked from the server where ``command`` runs a posttrain entry module (see the module docstring)."""
    if options.pop("capture_output", True) is not True or options.pop("text", True) is not True:
        raise ValueError("run_command always captures the output as text")
    command = [str(c) for c in command]
    entry = forked_module(command)
    environment = dict(os.environ if env is None else env)
    if entry is None or options or not _same_import_time_environment(environment, SERVER.started().env):
        return subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout, **options)
    code, stdout, stderr, timed_out = SERVER.run(*entry, environment, cwd, timeout)
    if timed_out:
        raise subprocess.TimeoutExpired(command, timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(command, code, stdout, stderr)


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
        err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(stdin, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        threads = request["env"].get("OMP_NUM_THREADS")
        if threads:
            import torch

            torch.set_num_threads(int(threads))

        module = importlib.util.find_spec(request["module"])
        sys.argv = [module.origin, *request["arguments"]]
        try:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
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


def _wait(pid: int, timeout: float | None) -> tuple[int, bool]:
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), False
        if deadline is not None and time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            return -9, True
        time.sleep(0.02)


def serve() -> None:
    for name in PRELOADED:
        importlib.import_module(name)
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(request)
        code, timed_out = _wait(pid, request["timeout"])
        print(json.dumps(dict(returncode=code, timed_out=timed_out)), flush=True)


if __name__ == "__main__":
    serve()
