"""Which source files of posttrain one online training step passes through, and how often the
call path comes back into a file it is already inside (a callback: a lambda, a hook, a base
method calling down into a subclass). A readability figure for the online learner.

    python benchmarks/step_trace.py experiment=grpo_tiny

It trains the preset for one rollout batch (no warm start, a tiny budget) and traces the second
of two training steps with `sys.setprofile`. A re-entry is a call into file F from another file
while F is already on the call stack; `files` counts the distinct posttrain files entered.
"""

from __future__ import annotations

import sys
import tempfile
from collections import Counter
from pathlib import Path

import posttrain

PACKAGE = str(Path(posttrain.__file__).parent)


def short(path: str) -> str:
    return path[len(PACKAGE) + 1:]


def trace_step(step_fn):
    files: list[str] = []
    reentries: Counter = Counter()

    def profile(frame, event, arg):
        if event != "call" or not frame.f_code.co_filename.startswith(PACKAGE):
            return
        callee = frame.f_code.co_filename
        above, caller = set(), None
        back = frame.f_back
        while back is not None:
            name = back.f_code.co_filename
            if name.startswith(PACKAGE):
                caller = caller or name
                above.add(name)
            back = back.f_back
        if callee not in files:
            files.append(callee)
        if caller is not None and caller != callee and callee in above:
            reentries[short(callee)] += 1

    sys.setprofile(profile)
    try:
        return step_fn()
    finally:
        sys.setprofile(None)
        print(f"files: {len(files)}")
        for name in files:
            print(f"  {short(name)}")
        print(f"re-entries: {sum(reentries.values())}")
        for name, count in reentries.most_common():
            print(f"  {name}: {count}")


def main() -> None:
    from posttrain.algorithms.base import PosttrainModule
    from posttrain.train import main as train_main

    calls = {"n": 0}
    original = None

    def wrapped(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # the second step: past the first step's one-off work
            return trace_step(lambda: original(self, *args, **kwargs))
        return original(self, *args, **kwargs)

    from posttrain.algorithms.online import OnlineRLModule

    original = OnlineRLModule.training_step
    OnlineRLModule.training_step = wrapped
    assert PosttrainModule  # the base the online module extends
    with tempfile.TemporaryDirectory() as tmp:
        sys.argv = ["posttrain", *sys.argv[1:], "algorithm.warm_start.steps=0", "trainer.max_steps=2",
                    "trainer.val_check_interval=1000", "eval.num_prompts=8", "eval.at_start=false", "logger=none",
                    "eval.panel.size=0", f"hydra.run.dir={tmp}/run", f"paths.cache_dir={tmp}/cache"]
        train_main()


if __name__ == "__main__":
    main()
