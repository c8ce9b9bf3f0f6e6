"""Every command in the shell blocks of README.md runs as written, with a tiny budget appended
(those of docs/*.md: tests/test_docs_commands.py, with these helpers); and every link between
those pages leads somewhere.

The commands are read from the pages themselves, so a command added there is tested here. The
README's come first, then each page of docs/ in name order; a command shown on two pages runs
once. Placeholders name the runs of earlier commands: `outputs/<task>/runs/<time>` is the newest
run of that task, `outputs/multiruns/<time>` the newest sweep. Budget overrides are appended
(later overrides win in Hydra), so each command keeps its own choices. A sweep keeps every value
of its first two values of its first swept key and the first value of the others
(`algorithm=grpo,dr_grpo,dapo seed=0,1,2` runs 2 jobs, not 9): the launcher runs a multirun as
written, and each choice a sweep lists is run by the tests of its own group.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import sys
from pathlib import Path

from forked_cli import run_command

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCUMENTS = [README, *sorted((REPO / "docs").glob("*.md"))]  # the order their commands run in
SKIPPED = ("pip ", "python -m pytest")  # set-up and this very test suite
BUDGET = ["trainer.max_steps=2", "trainer.val_check_interval=2", "callbacks.checkpoint.every_n_train_steps=2",
          "eval.num_prompts=8", "eval.batch_size=8", "callbacks.progress_bar=none", "logger=csv"]
# online runs: a short warm start (shared by all of them through the cache), small batches
ONLINE_BUDGET = ["algorithm.warm_start.steps=20", "algorithm.prompts_per_step=2", "algorithm.group_size=4"]
OFFLINE = ("algorithm=sft", "experiment=sft_tiny")
# algorithm=prm: a short warm start and few step rows (sampled once, then trained on)
PROCESS_BUDGET = ["algorithm.warm_start.steps=20", "algorithm.process_data.num_train_prompts=8",
                  "algorithm.process_data.num_validation_prompts=4", "algorithm.process_data.rollouts_per_step=2"]


def readme_commands(documents: list[Path] = (README,)) -> list[str]:
    """The command lines of the documents' ```bash blocks, comments and continuations joined,
    each command once, in the order it first appears."""
    commands = []
    for document in documents:
        for block in re.findall(r"```bash\n(.*?)```", document.read_text(), flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                command = " ".join(line.split(" #", 1)[0].split())
                if command and not command.startswith("#") and not command.startswith(SKIPPED) \
                        and command not in commands:
                    commands.append(command)
    return commands


def fill_placeholders(command: str, log_dir: Path) -> str:
    def newest(pattern: str) -> str:
        found = sorted(log_dir.glob(pattern), key=os.path.getmtime)
        assert found, f"no {pattern} under {log_dir} for: {command}"
        return str(found[-1])

    command = re.sub(r"outputs/(\w+)/runs/<time>", lambda m: newest(f"{m.group(1)}/runs/*"), command)
    return re.sub(r"outputs/multiruns/<time>", lambda m: newest("multiruns/*"), command)


def one_value_past_the_first_sweep(arguments: list[str], first_values: int = 2) -> list[str]:
    """A multirun's first comma-separated key at its first `first_values` values; every later one
    at its first (`first_values=1`: the sweep's first job)."""
    swept, kept = False, []
    for argument in arguments:
        key, equals, values = argument.partition("=")
        if equals and "," in values and not values.startswith("["):
            argument = f"{key}={values.split(',')[0]}" if swept else f"{key}={','.join(values.split(',')[:first_values])}"
            swept = True
        kept.append(argument)
    return kept


def with_budget(arguments: list[str], log_dir: Path, model_dir: Path) -> list[str]:
    if arguments[:1] == ["posttrain"] and ("--help" in arguments or "--cfg" in arguments):
        return arguments
    if arguments[0] == "posttrain-eval":
        return arguments + ["eval.num_prompts=8", "eval.batch_size=8", "num_samples=2", "pass_k=[1,2]",
                            f"paths.log_dir={log_dir}"]
    if arguments[:2] == ["python", "benchmarks/vs_trl.py"]:
        # one short repeat with one KL setting, on a random tiny model (test_vs_trl_smoke runs each
        # worker at each KL setting)
        return arguments + ["--kl", "k3", "--repeats", "1", "--steps", "1", "--warmup", "1", "--seconds", "2",
                            "--seeds", "0",
                            "--eval-every", "2", "--threads", "1", "--model", str(model_dir),
                            "--out", str(log_dir / "vs_trl")]
    if arguments[0] == "posttrain-estimate":  # loads no weights and runs nothing: the config as written
        return arguments + [f"paths.cache_dir={log_dir / 'cache'}"]
    if arguments[0] in ("python", "posttrain-report"):  # benchmarks/ scripts and the report take their own arguments
        return arguments
    if "-m" in arguments:
        arguments = one_value_past_the_first_sweep(arguments)
    budget = list(BUDGET)
    if "algorithm=prm" in arguments:
        budget += PROCESS_BUDGET
    elif not any(a.startswith(OFFLINE) for a in arguments) and any(
            a.startswith(("algorithm=", "experiment=")) for a in arguments):
        budget += ONLINE_BUDGET
    if any(a.startswith("algorithm=") and "dapo" in a for a in arguments):
        # DAPO keeps a group only when some, not all, of its answers are right: after a 20-step
        # warm start only one-digit sums ever are
        budget += ["data.min_digits=1", "data.max_digits=1"]
    if any(a.startswith("teacher=tiny_") for a in arguments):
        budget += ["teacher_recipe.steps=5", "teacher_recipe.until_accuracy=null"]  # an embedded teacher recipe
    if any(a.startswith("resume=") for a in arguments):
        budget = ["trainer.max_steps=4"]  # its own overrides come back; only extend it
    if "hydra/launcher=slurm" in arguments:
        # no cluster here: the same sweep through the local launcher, and SLURM's own keys dropped
        arguments = [a.replace("hydra/launcher=slurm", "hydra/launcher=local") for a in arguments
                     if not a.startswith("hydra.launcher.")]
    return arguments + budget + [f"paths.log_dir={log_dir}"]


def as_process(arguments: list[str]) -> list[str]:
    """Run the entry points with this interpreter, as installed console scripts would."""
    if arguments[0] == "posttrain":
        return [sys.executable, "-m", "posttrain.train", *arguments[1:]]
    if arguments[0] == "posttrain-eval":
        return [sys.executable, "-m", "posttrain.eval.evaluate", *arguments[1:]]
    if arguments[0] == "posttrain-report":
        return [sys.executable, "-m", "posttrain.eval.report", *arguments[1:]]
    if arguments[0] == "posttrain-estimate":
        return [sys.executable, "-m", "posttrain.estimate", *arguments[1:]]
    if arguments[0] == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *arguments[1:]]
    if arguments[0] == "python":  # a script of the repository, by its path from the repository root
        return [sys.executable, str(REPO / arguments[1]), *arguments[2:]]
    raise AssertionError(f"documented command of an unknown program: {arguments}")


def test_a_sweep_runs_two_values_of_its_first_key_and_one_of_the_others():
    command = shlex.split("posttrain -m algorithm=grpo,dr_grpo,dapo seed=0,1,2 kl_estimator=k1,k3 eval.pass_k=[1,2]")
    assert one_value_past_the_first_sweep(command) == [
        "posttrain", "-m", "algorithm=grpo,dr_grpo", "seed=0", "kl_estimator=k1", "eval.pass_k=[1,2]"]
    assert one_value_past_the_first_sweep(command, first_values=1) == [  # the first job
        "posttrain", "-m", "algorithm=grpo", "seed=0", "kl_estimator=k1", "eval.pass_k=[1,2]"]


def test_readme_has_the_commands_it_promises():
    commands = readme_commands()
    assert "posttrain experiment=grpo_tiny" in commands
    assert any(c.startswith("posttrain resume=") for c in commands)
    assert any(c.startswith("posttrain-eval ") for c in commands)
    assert "posttrain --help" in commands


def run_documented_commands(commands: list[str], tmp_path: Path, model_dir: Path) -> None:
    """Run each command with its budget in one log directory, in order (later commands name the
    runs of earlier ones), and fail on the first that exits non-zero or prints a traceback."""
    log_dir = tmp_path / "outputs"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    for command in commands:
        if "vs_trl.py" in command and importlib.util.find_spec("trl") is None:
            continue  # the benchmark against TRL needs the `bench` extra
        arguments = with_budget(shlex.split(fill_placeholders(command, log_dir)), log_dir, model_dir)
        result = run_command(as_process(arguments), capture_output=True, text=True, timeout=600, cwd=tmp_path,
                             env=env)
        output = result.stdout + result.stderr
        assert result.returncode == 0, f"documented command failed: {command}\n{output[-4000:]}"
        assert "Traceback" not in output, f"{command}\n{output[-4000:]}"


def test_every_readme_command_runs(tmp_path, embedded_hf_model):
    """The README's commands; those of docs/ run in tests/test_docs_commands.py, on the other
    xdist worker."""
    run_documented_commands(readme_commands(), tmp_path, embedded_hf_model)


def anchor(heading: str) -> str:
    """The id GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_between_the_pages_resolve():
    """A relative link of README.md or docs/*.md names a file that exists and, with a #part,
    a heading of that file: moving a section must not leave a link behind."""
    broken = []
    for document in DOCUMENTS:
        text = re.sub(r"```.*?```", "", document.read_text(), flags=re.S)  # code is not a link
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, part = target.partition("#")
            linked = (document.parent / path).resolve() if path else document
            if not linked.exists():
                broken.append(f"{document.relative_to(REPO)}: {target} (no such file)")
            elif part and linked.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", linked.read_text(), flags=re.S),
                                      flags=re.M)
                if part not in {anchor(h) for h in headings}:
                    broken.append(f"{document.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
