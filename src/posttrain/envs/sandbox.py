"""Run model-written Python contained: `run_python(code)` -> SandboxResult, never raising for what
the code does.

Each call is two processes and a private directory:

  - the launcher (sandbox_launcher.py, in `python -I -S`), started by the caller in its own session
    with a minimal environment (the caller's, with its tokens, is not passed on); it dies with
    its caller. It enters new user, mount, IPC and PID namespaces, and a network namespace whose
    only device is a loopback that is down (no network), mounts a size-limited tmpfs on the
    private directory and on /dev/shm (in its own mount namespace: nothing outside sees them),
    writes the files there and forks
  - the program's process, the first of the new PID namespace: it takes its own session, sets
    its resource limits, walls itself in with Landlock (read and execute in the Python
    installation and the system's libraries, read and write only in its directory; no TCP bind
    or connect; no signal to a process outside) and a seccomp filter (no socket but the
    internet families the empty network namespace contains: no Unix socket by path, no vsock;
    no io_uring, which could open one past the filter), then execs Python on main.py.

The caller reads stdout and stderr as they come, up to `output_bytes` together, and stops the
run (SIGTERM to the launcher, which kills the program) when the output passes that or the wall
time runs out; when the program's first process ends, the kernel kills everything else in its
PID namespace, so nothing is left running; the launcher reaps it and reports its exit status
and CPU seconds on a pipe of its own. The directory is removed afterwards.

Statuses: ``ok`` (exit 0), ``error`` (a non-zero exit: an exception, a syntax error),
``timeout`` (the wall time, or the CPU time: the kernel kills it at `cpu_s`), ``memory`` (its
address space passed `memory_mb`: MemoryError), ``output_limit``, ``killed`` (another signal),
``refused`` (the sandbox could not be set up, or a bad request: nothing ran).

What the kernel allows is probed once (`isolation_report`); `check_isolation` refuses at
start-up when the network cannot be cut and the user did not opt in to a sandbox WITH network
(`env.sandbox.network=true`). Without user namespaces (only reachable with that opt-in) the
program runs without namespaces, and without Landlock or seccomp where those are missing:
`check_isolation` logs what is not enforced.

Known limits:
  - the program is PID 1 of its namespace: a signal it sends itself (os.kill(os.getpid(),
    SIGTERM)) is ignored unless it installed a handler; os.getppid() is 0.
  - as root, the kernel ignores RLIMIT_NPROC; the bound on processes is then the PID
    namespace's pid_max, which cannot go below 301 (at most 300 processes, each with its own
    `memory_mb` of address space). Run as a non-root user for the exact `processes` bound.
  - `memory_mb` bounds each process's address space, not their sum; `cpu_s` is whole seconds
    (rounded up) per process.
  - without namespaces (the network opt-in on a kernel without user namespaces) a process that
    leaves its process group may outlive the run, and neither `processes` nor `dir_bytes` holds.
"""

from __future__ import annotations

import functools
import logging
import marshal
import math
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from posttrain.errors import ConfigError

__all__ = ["SandboxLimits", "SandboxResult", "check_isolation", "isolation_report", "run_python"]

log = logging.getLogger(__name__)

MAIN = "main.py"             # the program's file in its directory
OPEN_FILES = 256             # RLIMIT_NOFILE
PID_MAX_FLOOR = 301          # the kernel's least pid_max for a PID namespace
STOP_GRACE_S = 2.0           # after SIGTERM, how long the launcher has to kill, reap and report
READ_CHUNK = 1 << 16         # bytes read from a pipe at a time
CPU_SLACK_S = 0.1            # a SIGKILL with this close to the CPU limit used was the CPU limit's
SHM_BYTES = 8 << 20          # the private /dev/shm (POSIX semaphores, multiprocessing's locks)
RUN_PREFIX = "posttrain-sandbox-"   # a run's directory in the temporary directory: RUN_PREFIX<caller's pid>-...
ORPHAN_AGE_S = 3600          # a run's directory left by a killed caller is removed when this old

# The launcher's environment and the program's (its HOME and TMPDIR are added: its directory).
# Nothing of the caller's: its environment holds tokens. One thread per numerical library: each
# thread counts against `processes`, and glibc's per-thread 64 MB arenas against `memory_mb`.
LAUNCHER_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LC_ALL": "C.UTF-8"}
PROGRAM_ENV = {**LAUNCHER_ENV, "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
               "MKL_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2"}


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use; `network=True` is the user's opt-in to a sandbox WITH network."""

    cpu_s: float = 2.0          # CPU seconds per process (RLIMIT_CPU, rounded up to whole seconds)
    wall_s: float = 5.0         # wall clock from the call, then the run is stopped
    memory_mb: int = 512        # address space per process (RLIMIT_AS)
    processes: int = 32         # processes and threads (RLIMIT_NPROC in its user namespace)
    output_bytes: int = 65536   # stdout+stderr kept; beyond it the run is stopped ("output_limit")
    file_bytes: int = 1 << 20   # largest file it may write (RLIMIT_FSIZE)
    network: bool = False       # True: the user opted in to a sandbox WITH network access
    dir_bytes: int = 16 << 20   # all the files in its directory together (the tmpfs's size)

    def __post_init__(self):
        for name in ("cpu_s", "wall_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        for name in ("memory_mb", "processes", "output_bytes", "file_bytes", "dir_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.network, bool):
            raise ValueError(f"network must be true or false, got {self.network!r}")


@dataclass
class SandboxResult:
    """One run: `status` says how it ended (see the module's docstring)."""

    status: str
    returncode: int | None     # the program's exit code, minus the signal that ended it; None: it did not end by itself
    stdout: str
    stderr: str
    wall_s: float
    truncated: bool            # the output was cut at output_bytes

    @property
    def ok(self) -> bool:
        return self.status == "ok"


# --- the launcher ----------------------------------------------------------------------------
# Runs in its own interpreter (`-I -S`: no site, nothing of the environment), so that nothing
# unsafe runs between fork and exec in the caller, which has threads. It imports no json (12 ms
# of start-up): the config comes as marshal (with the launcher's code, see START), the report
# goes back as words on a line.

LAUNCHER = (Path(__file__).parent / "sandbox_launcher.py").read_text()  # its own file: a program, not a module to import

# What `python -I -S -c` runs for each call: the launcher compiled once (compiling its source
# would cost each call 9 ms), from the run's file, with the run's config.
START = """# posttrain.envs.sandbox: one run's launcher
import marshal, sys
with open(sys.argv[1], "rb") as f:
    LAUNCHER, CONFIG = marshal.load(f)
exec(LAUNCHER)
"""


@functools.lru_cache(maxsize=None)
def _launcher_code():
    return compile(LAUNCHER, "<posttrain.envs.sandbox launcher>", "exec")


# --- what the kernel allows --------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def isolation_report() -> dict[str, bool | int | str]:
    """What this kernel allows the sandbox, probed once in a throwaway process: the namespaces
    (user, mount, ipc, pid, network), a tmpfs in them, `landlock` (its ABI, 0: none) and what
    that ABI gives (`filesystem_rules`, `tcp_rules`, `signal_scope`), `seccomp`,
    `process_limit` (what bounds `processes`), `kernel`, and `problem` (why a namespace failed)."""
    scratch = tempfile.mkdtemp(prefix=f"{RUN_PREFIX}{os.getpid()}-probe-")
    try:
        done = subprocess.run([sys.executable, "-I", "-S", "-c", LAUNCHER, "probe", scratch, str(PID_MAX_FLOOR)],
                              capture_output=True, env=LAUNCHER_ENV, timeout=60, check=False)
        found = marshal.loads(done.stdout)
    except (OSError, subprocess.SubprocessError, EOFError, ValueError, TypeError) as err:
        found = {"user_namespace": False, "mount_namespace": False, "ipc_namespace": False, "pid_namespace": False,
                 "network_namespace": False, "tmpfs": False, "pid_max": False, "landlock": 0, "seccomp": False,
                 "problem": f"the probe failed: {err}"}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    abi = found["landlock"]
    found.update(filesystem_rules=abi >= 1, tcp_rules=abi >= 4, signal_scope=abi >= 6, kernel=os.uname().release)
    namespaces = _namespaces(found)
    if namespaces and os.getuid() != 0:
        found["process_limit"] = "RLIMIT_NPROC"   # counted afresh in its user namespace
    elif namespaces and found["pid_max"]:
        found["process_limit"] = f"pid_max (root: at most {PID_MAX_FLOOR - 1} processes)"
    else:
        found["process_limit"] = "none"
    return found


def _namespaces(report: dict) -> bool:
    """Whether runs get their own user, mount, IPC and PID namespaces and tmpfs (all or none)."""
    return all(report.get(key) for key in ("user_namespace", "mount_namespace", "ipc_namespace", "pid_namespace",
                                           "tmpfs"))


def check_isolation(limits: SandboxLimits) -> None:
    """Refuse (ConfigError) to run model code with network access the user did not opt in to;
    log what else this kernel cannot enforce. Called once at start-up."""
    report = isolation_report()
    if not limits.network and not report.get("network_namespace"):
        raise ConfigError(
            "The code sandbox cannot cut model-written code off the network here: this kernel does not let it "
            f"create a network namespace ({report.get('problem') or 'unprivileged user namespaces are off'}; "
            f"kernel {report.get('kernel', os.uname().release)}). Allow unprivileged user namespaces (sysctl "
            "user.max_user_namespaces, kernel.unprivileged_userns_clone, or AppArmor's "
            "kernel.apparmor_restrict_unprivileged_userns=0), or set env.sandbox.network=true to run model code WITH "
            "network access.")
    missing = []
    if limits.network:
        missing.append("the network (env.sandbox.network=true)")
    if not _namespaces(report):
        missing.append("its own PID namespace and a size-limited directory (processes it leaves may outlive it)")
    if not report.get("landlock"):
        missing.append("Landlock (reading and writing outside its directory)")
    if not report.get("signal_scope"):
        missing.append("Landlock's signal scope (signals outside its PID namespace)")
    if not report.get("seccomp") and not limits.network:
        missing.append("seccomp (Unix sockets by path, vsock)")
    if str(report.get("process_limit", "none")).startswith("pid_max"):
        missing.append(f"an exact process count: as root the bound is pid_max, {PID_MAX_FLOOR - 1} processes")
    if missing:
        log.warning("The code sandbox does not contain model-written code's access to: %s.", "; ".join(missing))


# --- one run -------------------------------------------------------------------------------------

def run_python(code: str, *, stdin: str = "", limits: SandboxLimits = SandboxLimits(),
               files: dict[str, str] | None = None, args: list[str] = ()) -> SandboxResult:
    """Run `code` as main.py in a fresh sandbox (see the module's docstring), with `stdin`, the
    `files` (relative path -> text) beside it and `args` as sys.argv[1:]. Never raises for
    anything the code does."""
    started = time.monotonic()
    problem = _request_problem(code, stdin, files, args)
    if problem:
        return _refused(problem, started)
    report = isolation_report()
    if not limits.network and not report.get("network_namespace"):
        return _refused("this kernel cannot cut the program off the network, and env.sandbox.network is false "
                        "(see check_isolation)", started)
    _remove_orphaned_runs()
    root = tempfile.mkdtemp(prefix=f"{RUN_PREFIX}{os.getpid()}-")
    try:
        work = os.path.join(root, "work")
        os.mkdir(work, 0o700)
        launch_path = os.path.join(root, "launch")
        with open(launch_path, "wb") as f:
            marshal.dump((_launcher_code(), _config(code, files or {}, args, limits, report, work)), f)
        return _supervise(launch_path, stdin, limits, started)
    finally:
        _remove_tree(root)


def _request_problem(code, stdin, files, args) -> str:
    """Why the request itself cannot run ("" when it can): the caller's types, file names."""
    if not isinstance(code, str) or not isinstance(stdin, str):
        return "code and stdin must be strings"
    if any(not isinstance(arg, str) or "\0" in arg for arg in args):
        return "args must be strings without NUL characters"
    for name, text in (files or {}).items():
        parts = name.split("/") if isinstance(name, str) else []
        if not parts or name.startswith("/") or "\0" in name or any(part in ("", ".", "..") for part in parts):
            return f"file name {name!r}: a relative path inside the sandbox's directory is needed"
        if name == MAIN:
            return f"file name {MAIN!r} is the program's own"
        if not isinstance(text, str):
            return f"file {name!r}: its content must be a string"
    return ""


def _rlimits(limits: SandboxLimits, namespaces: bool) -> list[tuple[int, int]]:
    """Every limit the kernel enforces on the program, soft = hard."""
    mb = 1 << 20
    rlimits = [(resource.RLIMIT_CPU, math.ceil(limits.cpu_s)),   # at the hard limit: SIGKILL
               (resource.RLIMIT_AS, limits.memory_mb * mb),
               (resource.RLIMIT_FSIZE, limits.file_bytes),
               (resource.RLIMIT_NOFILE, OPEN_FILES),
               (resource.RLIMIT_CORE, 0)]
    if namespaces:
        # counted afresh in its user namespace, where the launcher is one of them; outside one it
        # would count every process of the caller's user
        rlimits.append((resource.RLIMIT_NPROC, limits.processes + 1))
    return rlimits


def _config(code: str, files: dict[str, str], args, limits: SandboxLimits, report: dict, work: str) -> dict:
    """What the launcher needs, all decided here."""
    namespaces = _namespaces(report)
    # read and execute: the Python installation (a venv's and the one it points to), the system's libraries
    executable = os.path.realpath(sys.executable)
    readable = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                os.path.dirname(os.path.dirname(executable)), "/usr", "/lib", "/lib64", "/lib32", "/bin",
                "/etc/ld.so.cache", "/etc/localtime", "/dev/zero", "/dev/urandom", "/dev/random"}
    if limits.network:   # name resolution and certificates, for the user who opted in to network
        readable |= {"/etc/resolv.conf", "/etc/hosts", "/etc/nsswitch.conf", "/etc/gai.conf", "/etc/ssl"}
    writable = {work, "/dev/null"} | ({"/dev/shm"} if namespaces else set())
    rules = [(path, False) for path in sorted(readable)] + [(path, True) for path in sorted(writable)]
    return {
        "caller": os.getpid(), "namespaces": namespaces, "network": limits.network, "work": work,
        "dir_bytes": limits.dir_bytes, "shm_bytes": SHM_BYTES,
        "files": {MAIN: code.encode("utf-8", "surrogatepass"),
                  **{name: text.encode("utf-8", "surrogatepass") for name, text in files.items()}},
        "rlimits": _rlimits(limits, namespaces),
        "pid_max": max(limits.processes + 1, PID_MAX_FLOOR) if namespaces and os.getuid() == 0 else 0,
        "landlock": report.get("landlock", 0), "rules": rules, "seccomp": bool(report.get("seccomp")),
        # -E -s: nothing from the environment or the user's site; -B: no .pyc beside its files
        "python": sys.executable, "argv": [sys.executable, "-E", "-s", "-B", MAIN, *args],
        "env": {**PROGRAM_ENV, "HOME": work, "TMPDIR": work},
    }


def _supervise(launch_path: str, stdin: str, limits: SandboxLimits, started: float) -> SandboxResult:
    """Start the launcher, read the output as it comes, stop the run at the wall time or the
    output limit, and read the launcher's report."""
    status_read, status_write = os.pipe()
    try:
        with tempfile.TemporaryFile() as stdin_file:   # a file, not a pipe: nothing to write while reading
            stdin_file.write(stdin.encode("utf-8", "surrogatepass"))
            stdin_file.seek(0)
            launcher = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", START, launch_path, str(status_write)], stdin=stdin_file,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(status_write,), start_new_session=True,
                env=LAUNCHER_ENV, cwd=os.path.dirname(launch_path))
    except BaseException:
        os.close(status_read)
        raise
    finally:
        os.close(status_write)
    try:
        output, status_text, stopped = _collect(launcher, status_read, limits, started + limits.wall_s)
        _stop(launcher, force=bool(stopped))
        status_text += _read_rest(status_read)   # the launcher has ended: what it wrote last
    except BaseException:   # the caller interrupted (KeyboardInterrupt): the run must not outlive the call
        _stop(launcher, force=True)
        raise
    finally:
        launcher.stdout.close()
        launcher.stderr.close()
        os.close(status_read)
    stdout, stderr = (data.decode("utf-8", "replace") for data in output)
    status, returncode, problem = _outcome(status_text.decode("utf-8", "replace"), stderr, stopped, limits, launcher)
    if problem:
        stderr = problem if not stderr else f"{stderr}\n{problem}"
    return SandboxResult(status, returncode, stdout, stderr, time.monotonic() - started,
                         truncated=stopped == "output_limit")


def _collect(launcher: subprocess.Popen, status_read: int, limits: SandboxLimits,
             deadline: float) -> tuple[list[bytes], bytearray, str]:
    """Read stdout, stderr (output_bytes of them together) and the report pipe until all three
    close (the launcher and everything it started are gone), the output passes its limit, or
    the deadline: ([stdout, stderr], the report, "" | "output_limit" | "timeout")."""
    output = {launcher.stdout.fileno(): bytearray(), launcher.stderr.fileno(): bytearray()}
    status_text, kept = bytearray(), 0
    with selectors.DefaultSelector() as selector:
        for fd in (*output, status_read):
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return [bytes(data) for data in output.values()], status_text, "timeout"
            for key, _ in selector.select(remaining):
                data = os.read(key.fd, READ_CHUNK)
                if not data:
                    selector.unregister(key.fd)
                elif key.fd == status_read:
                    status_text += data
                else:
                    room = limits.output_bytes - kept
                    output[key.fd] += data[:room]
                    kept += min(len(data), room)
                    if len(data) > room:
                        return [bytes(data) for data in output.values()], status_text, "output_limit"
    return [bytes(data) for data in output.values()], status_text, ""


def _stop(launcher: subprocess.Popen, force: bool) -> None:
    """End the launcher: at once (force: SIGTERM, it kills the program, reaps and reports) or as
    it ends by itself; SIGKILL to its group when it does not end within STOP_GRACE_S."""
    if force:
        launcher.send_signal(signal.SIGTERM)
    try:
        launcher.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(launcher.pid, signal.SIGKILL)   # not reaped yet: its group id is still its own
        launcher.wait()


def _read_rest(fd: int) -> bytes:
    """What is left on the launcher's report pipe; it has ended, so this does not block."""
    chunks = []
    while chunk := os.read(fd, READ_CHUNK):
        chunks.append(chunk)
    return b"".join(chunks)


def _outcome(status_text: str, stderr: str, stopped: str, limits: SandboxLimits,
             launcher: subprocess.Popen) -> tuple[str, int | None, str]:
    """(status, returncode, a line to add to stderr) from the launcher's report."""
    if stopped == "timeout":
        return "timeout", None, f"[sandbox] stopped after {limits.wall_s:g} s of wall time"
    if stopped == "output_limit":
        return "output_limit", None, f"[sandbox] stopped: the output passed {limits.output_bytes} bytes"
    exited = None
    for line in status_text.splitlines():
        word, _, rest = line.partition(" ")
        if word == "refused":
            return "refused", None, f"[sandbox] refused: {rest}"
        if word == "exit":
            exited = rest.split()
    if exited is None:   # the launcher ended without a report: killed from outside, or it failed
        status = "killed" if launcher.returncode < 0 else "refused"
        return status, None, f"[sandbox] the launcher ended with status {launcher.returncode}"
    returncode, cpu = int(exited[0]), float(exited[1])
    if returncode == 0:
        return "ok", 0, ""
    if returncode in (-signal.SIGKILL, -signal.SIGXCPU) and cpu >= math.ceil(limits.cpu_s) - CPU_SLACK_S:
        return "timeout", returncode, f"[sandbox] stopped after {math.ceil(limits.cpu_s)} s of CPU time"
    if _out_of_memory(stderr):
        return "memory", returncode, ""
    if returncode < 0:
        return "killed", returncode, f"[sandbox] killed by signal {-returncode}"
    return "error", returncode, ""


def _out_of_memory(stderr: str) -> bool:
    """Whether the program failed for want of address space: an uncaught MemoryError, or the
    interpreter could not allocate."""
    tail = stderr[-2000:]
    return "MemoryError" in tail or "Cannot allocate memory" in tail or "Could not allocate memory" in tail


def _refused(reason: str, started: float) -> SandboxResult:
    return SandboxResult("refused", None, "", f"[sandbox] refused: {reason}", time.monotonic() - started, False)


@functools.lru_cache(maxsize=None)
def _remove_orphaned_runs() -> None:
    """Once per process: remove the directories of runs whose caller was killed before it could
    (SIGKILL: no clean-up) -- its pid gone, the directory older than ORPHAN_AGE_S (a /tmp shared
    with another PID namespace shows a live caller as gone: its runs are younger)."""
    temporary = tempfile.gettempdir()
    for name in os.listdir(temporary):
        pid = name[len(RUN_PREFIX):].split("-")[0]
        if not name.startswith(RUN_PREFIX) or not pid.isdigit():
            continue
        path = os.path.join(temporary, name)
        try:
            os.kill(int(pid), 0)
            continue   # alive (or another user's process now)
        except ProcessLookupError:
            pass
        except OSError:
            continue
        try:
            if time.time() - os.stat(path).st_mtime > ORPHAN_AGE_S:
                _remove_tree(path)
        except OSError:
            pass


def _remove_tree(path: str) -> None:
    """Remove the run's directory, whatever permissions the program left on what it wrote."""
    try:
        shutil.rmtree(path)
    except OSError:
        for directory, subdirectories, _ in os.walk(path):   # top down: opened before it descends
            for name in subdirectories:
                try:
                    os.chmod(os.path.join(directory, name), 0o700)
                except OSError:
                    pass
        shutil.rmtree(path, ignore_errors=True)
