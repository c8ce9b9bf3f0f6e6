"""The code sandbox (envs/sandbox.py): each hostile program a model could write is contained with
its own status, the caller goes on untouched, and nothing outside the sandbox changes; then the
ordinary runs (stdout, stdin, files, args, exit codes), and the start-up check that refuses a
sandbox that cannot cut the network unless the user opted in.

Tests of a kernel feature skip, naming it, where the kernel lacks it. Time limits are asserted
through the status (what stopped the run), not through wall-clock figures a loaded machine
would stretch."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import tracemalloc
from pathlib import Path

import pytest
from conftest import load_benchmark

from posttrain.envs import sandbox
from posttrain.envs.sandbox import SandboxLimits, SandboxResult, check_isolation, isolation_report, run_python
from posttrain.errors import ConfigError

# where the kernel cannot cut the network, the runs opt in to it (as a user there would), and the
# tests of what only namespaces contain skip
OPT_IN = not isolation_report()["network_namespace"]


def limits(**changes) -> SandboxLimits:
    return SandboxLimits(**{"cpu_s": 1, "wall_s": 10, "network": OPT_IN, **changes})


FAST = limits()


def program(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


def require(*features: str) -> None:
    """Skip unless this kernel gives the sandbox every one of `features` (isolation_report keys)."""
    report = isolation_report()
    missing = [feature for feature in features if not report.get(feature)]
    if missing:
        pytest.skip(f"this kernel ({report['kernel']}) does not allow: {', '.join(missing)} ({report['problem']})")


def sandbox_processes(work: str) -> list[int]:
    """The processes still running from the run whose directory was `work` (their environment
    names it as HOME)."""
    marker = f"HOME={work}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:   # gone meanwhile, or not ours to read
                pass
    return found


@pytest.fixture
def caller_unaffected():
    """The caller after a run: alive (the test goes on), still able to start a process, and
    holding as many file descriptors as before."""
    before = len(os.listdir("/proc/self/fd"))
    yield
    assert subprocess.run(["true"], check=False).returncode == 0
    assert len(os.listdir("/proc/self/fd")) == before


PRINT_WORKDIR = "import os\nprint(os.getcwd(), flush=True)\n"   # first line: for the leftover checks


# --- hostile programs ------------------------------------------------------------------------

def test_an_infinite_loop_stops_at_the_cpu_limit(caller_unaffected):
    result = run_python("while True:\n    pass\n", limits=limits(cpu_s=1, wall_s=60))
    assert result.status == "timeout" and not result.ok
    assert result.returncode == -signal.SIGKILL   # the kernel's kill at RLIMIT_CPU, long before the wall time
    assert "1 s of CPU time" in result.stderr


def test_a_program_that_sleeps_stops_at_the_wall_time(caller_unaffected):
    result = run_python(PRINT_WORKDIR + "import time\ntime.sleep(100)\n", limits=limits(wall_s=1))
    assert result.status == "timeout" and result.returncode is None
    assert 1 <= result.wall_s < 10   # stopped at its limit, not left to sleep on
    work = result.stdout.split()[0]
    assert sandbox_processes(work) == [] and not os.path.exists(os.path.dirname(work))


def test_a_fork_bomb_is_contained_and_leaves_nothing_running(caller_unaffected):
    require("pid_namespace")
    code = PRINT_WORKDIR + program("""
        while True:
            try:
                os.fork()
            except OSError:
                pass
        """)
    result = run_python(code, limits=limits(wall_s=1.5))
    assert result.status == "timeout"
    work = result.stdout.split()[0]
    assert sandbox_processes(work) == []
    assert not os.path.exists(os.path.dirname(work))


def test_processes_are_bounded(caller_unaffected):
    """Children that stay alive: forking fails at the bound (exact where RLIMIT_NPROC applies; as
    root the kernel ignores it and the PID namespace's pid_max bounds them); they die with it."""
    require("pid_namespace")
    code = program("""
        import os, time
        started = 0
        for _ in range(1000):
            try:
                if os.fork() == 0:
                    time.sleep(60)
                    os._exit(0)
                started += 1
            except OSError:
                break
        print(started)
        """)
    bounded = limits(processes=8, wall_s=30)
    result = run_python(code, limits=bounded)
    # ok, not timeout: the sleeping children (which hold its stdout) did not keep the run open
    assert result.status == "ok", result.stderr
    if isolation_report()["process_limit"] == "RLIMIT_NPROC":
        assert int(result.stdout) == bounded.processes - 1   # and the program itself
    else:
        assert int(result.stdout) <= sandbox.PID_MAX_FLOOR - 1


def test_a_10_gb_allocation_fails_with_memory(caller_unaffected):
    result = run_python("data = bytearray(10 * 2**30)\n", limits=FAST)
    assert result.status == "memory"
    assert result.stderr.rstrip().endswith("MemoryError")


def test_memory_grown_step_by_step_stops_at_the_limit(caller_unaffected):
    code = "chunks = []\nwhile True:\n    chunks.append(bytearray(2**20))\n"
    assert run_python(code, limits=limits(memory_mb=128, wall_s=30)).status == "memory"


def test_files_outside_its_directory_cannot_be_read(tmp_path, caller_unaffected):
    require("filesystem_rules")
    secret = tmp_path / "secret.txt"
    secret.write_text("the caller's secret")
    code = program(f"""
        for path in ["/etc/passwd", {str(secret)!r}, "/proc/1/environ"]:
            try:
                print(open(path).read())
            except OSError as err:
                print("denied", type(err).__name__)
        """)
    result = run_python(code, limits=FAST)
    assert result.status == "ok"
    assert result.stdout.splitlines() == ["denied PermissionError"] * 3


def test_nothing_can_be_written_outside_its_directory(tmp_path, caller_unaffected):
    require("filesystem_rules")
    (tmp_path / "keep").write_text("kept")
    target, keep = str(tmp_path / "written"), str(tmp_path / "keep")
    code = program(f"""
        import os
        for act in [lambda: open({target!r}, "w").write("x"), lambda: os.mkdir({target!r}),
                    lambda: os.symlink("/etc", {target!r}), lambda: os.remove({keep!r}),
                    lambda: os.rename({keep!r}, "stolen")]:
            try:
                act()
                print("done")
            except OSError as err:
                print("denied", type(err).__name__)
        """)
    result = run_python(code, limits=FAST)
    assert result.status == "ok"
    assert result.stdout.splitlines()[:4] == ["denied PermissionError"] * 4
    assert result.stdout.splitlines()[4].startswith("denied")   # EXDEV or EACCES: either way it stays
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep"] and (tmp_path / "keep").read_text() == "kept"


def test_files_are_bounded_in_size_and_in_total(caller_unaffected):
    code = program("""
        for size in [2**21, 2**19]:
            try:
                open("one", "wb").write(b"x" * size)
                print("wrote", size)
            except OSError as err:
                print(err.strerror)
        try:
            for i in range(100):
                open(f"f{i}", "wb").write(b"x" * 2**19)
        except OSError as err:
            print(err.strerror, i)
        """)
    result = run_python(code, limits=limits(file_bytes=1 << 20, dir_bytes=4 << 20))
    lines = result.stdout.splitlines()
    assert lines[:2] == ["File too large", f"wrote {2**19}"]
    if sandbox._namespaces(isolation_report()):   # its directory is a tmpfs of dir_bytes
        assert lines[2].startswith("No space left on device") and int(lines[2].split()[-1]) < 8


def test_a_socket_reaches_no_server_of_the_caller(tmp_path, caller_unaffected):
    require("network_namespace")
    tcp = socket.create_server(("127.0.0.1", 0))
    unix_path = str(tmp_path / "server.sock")
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(unix_path)
    unix.listen()
    port = tcp.getsockname()[1]
    code = program(f"""
        import socket
        for family, address in [(socket.AF_INET, ("127.0.0.1", {port})), (socket.AF_UNIX, {unix_path!r})]:
            try:
                s = socket.socket(family)
                s.settimeout(1)
                s.connect(address)
                print("connected")
            except OSError as err:
                print("failed", type(err).__name__)
        try:
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", ("127.0.0.1", {port}))
            print("sent")
        except OSError as err:
            print("failed", type(err).__name__)
        """)
    try:
        result = run_python(code, limits=FAST)
        assert result.status == "ok", result.stderr
        assert [line.split()[0] for line in result.stdout.splitlines()] == ["failed"] * 3
        for server in (tcp, unix):
            server.setblocking(False)
            with pytest.raises(BlockingIOError):   # nothing came to accept
                server.accept()
    finally:
        tcp.close()
        unix.close()


def test_printing_a_gigabyte_stops_at_the_output_limit(caller_unaffected):
    code = "import sys\nfor _ in range(2**14):\n    sys.stdout.write('x' * 2**16)\n"   # 1 GiB
    tracemalloc.start()
    try:
        result = run_python(code, limits=limits(output_bytes=65536, wall_s=60))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.status == "output_limit" and result.truncated and result.returncode is None
    assert result.stdout == "x" * 65536
    assert peak < 4 << 20   # the caller never held more than the kept output and a read's chunk


def test_killing_its_parent_or_the_callers_group_reaches_nothing(caller_unaffected):
    require("pid_namespace")   # without one, kill(-1) would reach every process of this user
    canary = subprocess.Popen(["sleep", "60"], start_new_session=True)   # in its own group, like the caller's
    try:
        targets = [("kill", "os.getppid()"), ("kill", os.getpid()), ("killpg", os.getpgid(0)),
                   ("kill", canary.pid), ("killpg", canary.pid), ("kill", -1)]
        code = "import os\n" + "".join(
            f"try:\n    os.{how}({pid}, 9)\nexcept OSError as err:\n    print('{how}', type(err).__name__)\n"
            for how, pid in targets) + "print('still here')\n"
        result = run_python(code, limits=FAST)
        assert canary.poll() is None
    finally:
        canary.kill()
        canary.wait()
    # os.getppid() is 0 in its PID namespace: kill(0) is its own group, which holds only itself,
    # PID 1 of the namespace, whom its own signals do not kill; the others are not there to see
    assert result.status == "ok", result.stderr
    assert result.stdout.splitlines()[-1] == "still here"


def processes_with_argument(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def test_a_killed_caller_takes_the_run_with_it(tmp_path):
    """The trainer killed mid-run (SIGKILL: no clean-up of its own): the launcher and the program,
    and what the program forked, end with it."""
    require("pid_namespace")
    marker = f"posttrain-sandbox-test-{os.getpid()}-{tmp_path.name}"
    caller = subprocess.Popen([sys.executable, "-c", program(f"""
        from posttrain.envs.sandbox import SandboxLimits, run_python
        run_python("import os, time\\nos.fork()\\ntime.sleep(100)\\n", args=[{marker!r}],
                   limits=SandboxLimits(wall_s=100, network={OPT_IN}))
        """)])
    try:
        deadline = time.monotonic() + 30
        while len(processes_with_argument(marker)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(processes_with_argument(marker)) == 2   # the program and its child, asleep
    finally:
        caller.kill()
        caller.wait()
    deadline = time.monotonic() + 10
    while processes_with_argument(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_with_argument(marker) == []
    # its directory, which it could not remove, goes once it is old: the next caller sweeps it
    left = list(Path(tempfile.gettempdir()).glob(f"{sandbox.RUN_PREFIX}{caller.pid}-*"))
    assert len(left) == 1
    os.utime(left[0], (0, time.time() - sandbox.ORPHAN_AGE_S - 1))
    sandbox._remove_orphaned_runs.__wrapped__()
    assert not left[0].exists()


def test_a_syntax_error_is_an_error_with_the_traceback(caller_unaffected):
    result = run_python("def f(:\n    pass\n", limits=FAST)
    assert result.status == "error" and result.returncode == 1
    assert "SyntaxError" in result.stderr


def test_a_crash_is_killed(caller_unaffected):
    result = run_python("import ctypes\nctypes.string_at(0)\n", limits=FAST)
    assert result.status == "killed" and result.returncode == -signal.SIGSEGV


def test_the_callers_environment_and_shared_memory_stay_outside(monkeypatch, caller_unaffected):
    require("mount_namespace")
    monkeypatch.setenv("POSTTRAIN_TEST_TOKEN", "hunter2")
    code = program("""
        import os
        from multiprocessing import shared_memory
        print("hunter2" in str(os.environ))
        shared_memory.SharedMemory(name="posttrain_sandbox_test", create=True, size=64)
        print("shm ok")
        """)
    result = run_python(code, limits=FAST)
    assert result.stdout.splitlines() == ["False", "shm ok"], result.stderr
    assert not os.path.exists("/dev/shm/posttrain_sandbox_test")   # its /dev/shm was its own


def test_pid_max_is_set_in_its_namespace_only():
    before = Path("/proc/sys/kernel/pid_max").read_text()
    assert run_python("import os\nos.fork()\n", limits=FAST).ok
    assert Path("/proc/sys/kernel/pid_max").read_text() == before


# --- ordinary runs ---------------------------------------------------------------------------

def test_stdout_stdin_files_and_args():
    code = program("""
        import sys, helper
        print(sys.stdin.read().upper())
        print(helper.VALUE, open("data/in.txt").read())
        print(sys.argv[1:])
        print("to stderr", file=sys.stderr)
        """)
    result = run_python(code, stdin="from stdin", files={"helper.py": "VALUE = 42\n", "data/in.txt": "a file"},
                        args=["--flag", "x y"], limits=FAST)
    assert result.status == "ok" and result.ok and result.returncode == 0 and not result.truncated
    assert result.stdout == "FROM STDIN\n42 a file\n['--flag', 'x y']\n"
    assert result.stderr == "to stderr\n"


def test_exit_codes_and_exceptions():
    assert run_python("import sys\nsys.exit(3)\n", limits=FAST).returncode == 3
    failed = run_python("raise ValueError('bad')\n", limits=FAST)
    assert failed.status == "error" and failed.returncode == 1 and "ValueError: bad" in failed.stderr
    assert run_python("exit(0)\n", limits=FAST).status == "ok"


def test_unicode_and_a_large_stdin():
    text = "é" * 200_000 + "\n"
    result = run_python("import sys\ndata = sys.stdin.read()\nprint(len(data), data[:3])\n", stdin=text, limits=FAST)
    assert result.stdout == "200001 ééé\n"


def test_the_directory_is_removed_and_nothing_is_left_running(caller_unaffected):
    require("pid_namespace")   # without one, a process that leaves its group outlives the run
    code = PRINT_WORKDIR + program("""
        open("scratch.txt", "w").write("x")
        if os.fork() == 0:          # a daemon: its own session, a grandchild that sleeps on
            os.setsid()
            if os.fork() == 0:
                import time
                time.sleep(60)
            os._exit(0)
        """)
    result = run_python(code, limits=limits(wall_s=30))
    assert result.status == "ok", result.stderr   # not timeout: the grandchild did not keep it open
    work = result.stdout.split()[0]
    assert Path(work).name == "work" and not os.path.exists(os.path.dirname(work))
    assert sandbox_processes(work) == []


def test_bad_requests_are_refused_without_running():
    for files in ({"../x.py": ""}, {"/abs.py": ""}, {"main.py": ""}, {"a//b": ""}):
        result = run_python("print(1)\n", files=files, limits=FAST)
        assert result.status == "refused" and result.returncode is None and result.stdout == ""
    assert run_python("print(1)\n", args=["a\0b"], limits=FAST).status == "refused"


def test_limits_are_checked():
    for bad in ({"cpu_s": 0}, {"wall_s": -1}, {"memory_mb": 0}, {"processes": 1.5}, {"network": "yes"},
                {"output_bytes": True}):
        with pytest.raises(ValueError):
            SandboxLimits(**bad)


def test_result_ok_is_the_status():
    assert SandboxResult("ok", 0, "", "", 0.1, False).ok
    assert not SandboxResult("error", 1, "", "", 0.1, False).ok


# --- the start-up check ----------------------------------------------------------------------

def test_this_kernel_is_reported():
    report = isolation_report()
    assert report is isolation_report()   # probed once
    for key in ("network_namespace", "pid_namespace", "landlock", "signal_scope", "seccomp", "process_limit"):
        assert key in report
    if report["network_namespace"]:
        check_isolation(SandboxLimits())   # does not raise


NO_ISOLATION = {"user_namespace": False, "mount_namespace": False, "ipc_namespace": False, "pid_namespace": False,
                "network_namespace": False, "tmpfs": False, "pid_max": False, "landlock": 0, "seccomp": False,
                "filesystem_rules": False, "tcp_rules": False, "signal_scope": False, "process_limit": "none",
                "kernel": "4.4.0-test", "problem": "unshare(CLONE_NEWUSER): Operation not permitted"}


def test_without_a_network_namespace_it_refuses_unless_the_user_opts_in(monkeypatch, caplog):
    monkeypatch.setattr(sandbox, "isolation_report", lambda: dict(NO_ISOLATION))
    with pytest.raises(ConfigError, match=r"env\.sandbox\.network=true") as raised:
        check_isolation(SandboxLimits())
    assert "network namespace" in str(raised.value) and "Operation not permitted" in str(raised.value)
    refused = run_python("print(1)\n", limits=SandboxLimits(cpu_s=1, wall_s=10))
    assert refused.status == "refused" and "network" in refused.stderr
    # opted in: it runs (without namespaces, Landlock or seccomp here) and says what is not contained
    with_network = SandboxLimits(cpu_s=1, wall_s=10, network=True)
    with caplog.at_level(logging.WARNING, logger="posttrain.envs.sandbox"):
        check_isolation(with_network)
    assert "Landlock" in caplog.text and "network" in caplog.text
    result = run_python("import sys\nprint(sys.stdin.read())\n", stdin="runs", limits=with_network)
    assert result.status == "ok" and result.stdout == "runs\n", result.stderr


# --- the benchmark -----------------------------------------------------------------------------

def test_the_cost_benchmark_runs_and_tabulates(capsys):
    """benchmarks/sandbox_cost.py with one call per row (speed is reported there, not asserted)."""
    require("network_namespace")   # it runs the default limits: no network
    times = load_benchmark("sandbox_cost").main(["--calls", "1"])
    assert set(times) == {"trivial", "unit tests"}
    assert all(len(runs["sandbox"]) == len(runs["bare"]) == 1 for runs in times.values())
    table = capsys.readouterr().out
    assert "| trivial |" in table and "| unit tests |" in table and "sandbox / bare" in table
