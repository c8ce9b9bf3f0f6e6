"""The code sandbox's cost per call: `run_python` against a bare `subprocess.run` of the same code.

    python benchmarks/sandbox_cost.py [--calls 50]

Two programs: ``trivial`` (one print) and ``unit tests`` (a function and a unittest.TestCase of
five tests, run with unittest.main: what a code task's check looks like). Each row times
`--calls` calls of envs/sandbox.py's `run_python` (default SandboxLimits: namespaces, tmpfs,
Landlock, seccomp, limits, as the kernel allows) and as many of a bare
`subprocess.run([sys.executable, "-c", code], capture_output=True)`, interleaved (sandbox then
bare, then bare then sandbox: a slow spell on a shared machine hits both alike) after one
untimed warm-up of each. Wall milliseconds per call, median and 90th percentile, and the
sandbox's median over the bare one's (sandbox / bare). The first line says what the sandbox
could use here (isolation_report).

Speed is reported here, never asserted in tests.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from posttrain.envs.sandbox import SandboxLimits, isolation_report, run_python

PROGRAMS = {
    "trivial": "print('hello')\n",
    "unit tests": '''import unittest


def running_max(values):
    best, out = None, []
    for value in values:
        best = value if best is None or value > best else best
        out.append(best)
    return out


class RunningMax(unittest.TestCase):
    def test_empty(self):
        self.assertEqual(running_max([]), [])

    def test_one(self):
        self.assertEqual(running_max([3]), [3])

    def test_rising(self):
        self.assertEqual(running_max([1, 2, 3]), [1, 2, 3])

    def test_falling(self):
        self.assertEqual(running_max([3, 2, 1]), [3, 3, 3])

    def test_mixed(self):
        self.assertEqual(running_max([2, 5, 1, 7, 3]), [2, 5, 5, 7, 7])


unittest.main(exit=True, verbosity=0)
''',
}


def sandboxed(code: str) -> float:
    started = time.perf_counter()
    result = run_python(code, limits=SandboxLimits())
    if not result.ok:
        raise RuntimeError(f"the sandbox run failed ({result.status}): {result.stderr}")
    return time.perf_counter() - started


def bare(code: str) -> float:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, check=False)
    if done.returncode:
        raise RuntimeError(f"the bare run failed: {done.stderr.decode()}")
    return time.perf_counter() - started


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def measure(calls: int) -> dict[str, dict[str, list[float]]]:
    """Seconds per call: {program: {"sandbox": [...], "bare": [...]}}."""
    times = {}
    for name, code in PROGRAMS.items():
        sandboxed(code), bare(code)   # warm-up: the isolation probe, the page cache
        runs = {"sandbox": [], "bare": []}
        for call in range(calls):
            order = ("sandbox", "bare") if call % 2 == 0 else ("bare", "sandbox")
            for row in order:
                runs[row].append(sandboxed(code) if row == "sandbox" else bare(code))
        times[name] = runs
    return times


def table(times: dict[str, dict[str, list[float]]]) -> str:
    lines = ["| program | sandbox median ms | sandbox p90 ms | bare median ms | bare p90 ms | sandbox / bare |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, runs in times.items():
        cells = []
        for row in ("sandbox", "bare"):
            cells += [f"{1000 * statistics.median(runs[row]):.1f}", f"{1000 * percentile(runs[row], 0.9):.1f}"]
        ratio = statistics.median(runs["sandbox"]) / statistics.median(runs["bare"])
        lines.append(f"| {name} | {' | '.join(cells)} | {ratio:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50, help="timed calls per program and row")
    args = parser.parse_args(argv)
    report = isolation_report()
    used = [name for name in ("user_namespace", "pid_namespace", "network_namespace", "tmpfs", "seccomp")
            if report.get(name)]
    print(f"kernel {report['kernel']}: {', '.join(used)}, Landlock ABI {report['landlock']}, "
          f"process limit: {report['process_limit']}; {args.calls} calls per row\n")
    times = measure(args.calls)
    print(table(times))
    return times


if __name__ == "__main__":
    main()
