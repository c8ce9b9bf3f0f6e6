"""The prompt panel of several runs, read side by side: `posttrain-report --compare RUN... [--at BATCH...]`.

Every run answers the same panel of held-out prompts at each evaluation
(`<run dir>/panel/batch<N>.jsonl`, docs/panel.md). `write_panel_pages` writes, offline, in
markdown: `index.md`, the panel's prompts with each run's reward at the last chosen batch, and
one page per prompt (`prompt<i>.md`): the prompt, its reference, then per chosen batch a table
with one column per run: its response, its reward and each reward component, whether it is right.

Chosen batches: by default the first and the last batch any run evaluated at. A run that did
not evaluate at a chosen batch is shown at its nearest one (the earlier on a tie), and its
column says which.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass, field
from pathlib import Path

from posttrain.data.sources import json_lines
from posttrain.errors import DataError
from posttrain.eval.report.runs import load_history, read_overrides
from posttrain.eval.report.suites import suite_keys_in, value_cell
from posttrain.eval.report.tables import markdown_table

PANEL_DIR = "panel"
PANEL_FILE = re.compile(r"batch(\d+)\.jsonl")
# directories of a sweep that hold runs made for it, not runs of it (the SFT warm start, teachers)
NOT_SWEEP_RUNS = ("cache", "warm_start")
MISSING = "—"


@dataclass
class PanelRun:
    """One run's panel files, and the name its column gets."""

    path: Path
    files: dict[int, Path]  # training batches seen -> panel/batch<N>.jsonl
    label: str = ""
    answers: dict[int, dict[str, dict]] = field(default_factory=dict)  # chosen batch -> prompt -> its line

    def nearest_batch(self, batch: int) -> int:
        """The batch this run evaluated at nearest to `batch` (the earlier on a tie)."""
        return min(self.files, key=lambda evaluated: (abs(evaluated - batch), evaluated))


def write_panel_pages(run_dirs: list[Path], out_dir: Path, at_batches: list[int] | None = None) -> Path:
    """The panel pages of `run_dirs` (run directories, or sweep directories standing for the runs
    below them) at `at_batches` (None: the first and last evaluated) in `out_dir`; returns the
    path of its index.md. A directory without any panel file is a DataError."""
    runs = find_panel_runs([Path(p) for p in run_dirs])
    name_runs(runs)
    batches = chosen_batches(runs, at_batches)
    for run in runs:
        run.answers = {batch: read_panel_file(run.files[run.nearest_batch(batch)]) for batch in batches}
    prompts = panel_prompts(runs, batches)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("prompt[0-9]*.md"):  # an earlier comparison's, perhaps of a larger panel
        stale.unlink()
    for number, prompt in enumerate(prompts, start=1):
        (out_dir / page_name(number)).write_text(prompt_page(runs, batches, prompts, number))
    index = out_dir / "index.md"
    index.write_text(index_page(runs, batches, prompts))
    return index


# --- reading the runs ---------------------------------------------------------------------------


def find_panel_runs(paths: list[Path]) -> list[PanelRun]:
    """The runs of `paths`: a run directory with panel files is one run, any other directory
    stands for the runs below it (in natural order: job 2 before job 10)."""
    runs: list[PanelRun] = []
    for path in paths:
        if not path.is_dir():
            raise DataError(f"{path}: no such directory (expected a run directory or a sweep directory)")
        found = [path] if panel_files(path) else sorted(
            (panel.parent for panel in path.rglob(PANEL_DIR)
             if panel_files(panel.parent) and not set(panel.relative_to(path).parts) & set(NOT_SWEEP_RUNS)),
            key=natural_order)
        if not found:
            raise DataError(f"{path}: no run with panel files ({PANEL_DIR}/batch<N>.jsonl) in or below it; a run "
                            f"writes them at each held-out evaluation when eval.panel.size > 0 or eval.panel.file "
                            f"is set")
        runs += [PanelRun(run_dir, panel_files(run_dir)) for run_dir in found if run_dir not in [r.path for r in runs]]
    return runs


def panel_files(run_dir: Path) -> dict[int, Path]:
    """{training batches seen: its panel file} of a run directory (empty: none)."""
    folder = run_dir / PANEL_DIR
    if not folder.is_dir():
        return {}
    matches = (PANEL_FILE.fullmatch(path.name) for path in folder.iterdir())
    return dict(sorted((int(match.group(1)), folder / match.group(0)) for match in matches if match))


def natural_order(path: Path) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(path))]


def read_panel_file(path: Path) -> dict[str, dict]:
    """A panel file's lines by prompt; a line that is not a JSON object with a prompt and a
    response is a DataError naming file:line."""
    answers = {}
    for where, _, row in json_lines(path):
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or "response" not in row:
            raise DataError(f"{where}: a panel line is a JSON object with 'prompt' and 'response' "
                            f"(written by a run at its held-out evaluation)")
        answers[row["prompt"]] = row
    return answers


def name_runs(runs: list[PanelRun]) -> None:
    """Each run's column name: the command-line overrides in which the runs differ (`seed=1`;
    a group's own settings left out where the group's choice differs: `algorithm=grpo`, not
    also its `algorithm.group_size=8`), else its directory's name, else its path below the
    runs' common folder."""
    overrides = [read_overrides(run.path) for run in runs]
    differing = sorted(k for k in set().union(*overrides) if len({o.get(k) for o in overrides}) > 1)
    differing = [k for k in differing if not any(k.startswith(f"{group}.") for group in differing)]
    labels = [", ".join(f"{k}={o[k]}" for k in differing if k in o) for o in overrides]
    if not all(labels) or len(set(labels)) < len(runs):
        labels = [run.path.name for run in runs]
    if len(set(labels)) < len(runs):
        common = Path(*[parts[0] for parts in zip(*(run.path.resolve().parts for run in runs)) if len(set(parts)) == 1])
        labels = [str(run.path.resolve().relative_to(common)) for run in runs]
    for run, label in zip(runs, labels):
        run.label = label


def chosen_batches(runs: list[PanelRun], at_batches: list[int] | None) -> list[int]:
    """The batches the pages show, in order: `at_batches`; None: the first and the last batch
    any run evaluated at."""
    if at_batches:
        return sorted({int(batch) for batch in at_batches})
    evaluated = sorted({batch for run in runs for batch in run.files})
    return sorted({evaluated[0], evaluated[-1]})


def panel_prompts(runs: list[PanelRun], batches: list[int]) -> list[dict]:
    """The panel's prompts (their first line read: prompt, reference, answer), in the order of
    the first run's panel; prompts only a later run has come after."""
    prompts: dict[str, dict] = {}
    for run in runs:
        for batch in batches:
            for prompt, row in run.answers[batch].items():
                prompts.setdefault(prompt, row)
    return list(prompts.values())


# --- writing the pages --------------------------------------------------------------------------


def page_name(number: int) -> str:
    return f"prompt{number:03d}.md"


def index_page(runs: list[PanelRun], batches: list[int], prompts: list[dict]) -> str:
    last = batches[-1]
    lines = [f"# Prompt panel: {len(prompts)} prompts, {len(runs)} runs", "",
             "Each run's greedy response to the same held-out prompts (docs/panel.md). Runs:", ""]
    lines += [f"- **{escape(run.label)}**: `{run.path}` (evaluated at batches {', '.join(map(str, run.files))})"
              for run in runs]
    shown = ", ".join(map(str, batches))
    lines += ["", f"Pages show batches {shown} (a run that did not evaluate at one: its nearest).",
              f"The reward at batch {last}, ✓ a right answer:", ""]
    header = ["#", "prompt", "reference", *(escape(run.label) for run in runs)]
    body = []
    for number, prompt in enumerate(prompts, start=1):
        cells = [reward_cell(run.answers[last].get(prompt["prompt"])) for run in runs]
        body.append([f"[{number}]({page_name(number)})", code(prompt["prompt"]), code(reference(prompt)), *cells])
    means = [mean_reward(run.answers[last].values()) for run in runs]
    body.append(["", "**mean**", "", *means])
    return "\n".join(lines + markdown_table(header, body) + suites_lines(runs, last)) + "\n"


def suites_lines(runs: list[PanelRun], batch: int) -> list[str]:
    """Each run's evaluation suites and sources (eval/<suite>/<metric>, eval/<source>/accuracy) at
    batch `batch` (a run's nearest evaluation), from its metrics.jsonl; [] when no run logged any."""
    histories = [load_history(run.path) for run in runs]
    keys = suite_keys_in(histories)
    if not keys:
        return []
    body = [[f"`{key}`", *(value_cell(key, history.get(key, {}).get(run.nearest_batch(batch)))
                           for run, history in zip(runs, histories))] for key in keys]
    return ["", f"Evaluation suites and sources at batch {batch} (shares in %, lengths in tokens; "
                "docs/running.md, \"Evaluation suites\"):", "",
            *markdown_table(["metric", *(escape(run.label) for run in runs)], body)]


def prompt_page(runs: list[PanelRun], batches: list[int], prompts: list[dict], number: int) -> str:
    prompt = prompts[number - 1]
    links = ["[all prompts](index.md)"]
    if number > 1:
        links.append(f"[previous]({page_name(number - 1)})")
    if number < len(prompts):
        links.append(f"[next]({page_name(number + 1)})")
    lines = [f"# Panel prompt {number} of {len(prompts)}", "", " · ".join(links), "", "Prompt:", "",
             *fenced(prompt["prompt"]), "", "Reference:", "", *fenced(reference(prompt)), ""]
    for batch in batches:
        lines += [f"## Batch {batch}", "", *answers_table(runs, batch, prompt["prompt"]), ""]
    return "\n".join(lines)


def answers_table(runs: list[PanelRun], batch: int, prompt: str) -> list[str]:
    """One column per run: its response to `prompt` at `batch` (its nearest), reward, components."""
    rows = [run.answers[batch].get(prompt) for run in runs]
    components = list(dict.fromkeys(name for row in rows if row for name in row.get("components", {})))
    body = [["response", *(response_cell(row) for row in rows)],
            ["reward", *(number_cell(row, "reward") for row in rows)]]
    body += [[f"· {escape(name)}", *(number_cell(row and row.get("components", {}), name) for row in rows)]
             for name in components]
    body.append(["right", *(MISSING if row is None else "✓" if row.get("correct") else "✗" for row in rows)])
    body.append(["tokens", *(MISSING if row is None else str(row.get("length", MISSING)) for row in rows)])
    at = [run.nearest_batch(batch) for run in runs]
    if any(evaluated != batch for evaluated in at):
        body.append(["evaluated at batch", *map(str, at)])
    return markdown_table(["", *(escape(run.label) for run in runs)], body)


def response_cell(row: dict | None) -> str:
    if row is None:
        return f"{MISSING} (not on this run's panel)"
    cell = code(row["response"]) if row["response"] else "<em>(empty)</em>"
    return cell + (" <em>(cut at the token budget)</em>" if row.get("truncated") else "")


def reward_cell(row: dict | None) -> str:
    if row is None:
        return MISSING
    return f"{row['reward']:.3g} {'✓' if row.get('correct') else '✗'}"


def number_cell(values: dict | None, key: str) -> str:
    return MISSING if not values or values.get(key) is None else f"{values[key]:.3g}"


def mean_reward(rows) -> str:
    """The mean reward (each run's own reward: compare runs of one reward by it) and the right answers."""
    rows = list(rows)
    if not rows:
        return MISSING
    right = sum(bool(row.get("correct")) for row in rows)
    return f"**{sum(row['reward'] for row in rows) / len(rows):.3g}** ({right}/{len(rows)} ✓)"


def reference(prompt: dict) -> str:
    """The prompt's reference response, with its answer when that is not simply the response."""
    text, answer = prompt.get("reference") or "", prompt.get("answer")
    return text if answer is None or str(answer) == text.strip() else f"{text}\n(answer: {answer})"


def escape(text: str) -> str:
    """Text inside a markdown table cell: HTML-escaped (a response's `<think>` stays visible),
    pipes as entities (a cell ends at a bare one), line breaks as <br>."""
    return html.escape(text).replace("|", "&#124;").replace("\n", "<br>")


def code(text: str) -> str:
    return f"<code>{escape(text)}</code>"


def fenced(text: str) -> list[str]:
    """A code block of `text`, its fence longer than any run of backticks inside it."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return [f"{fence}text", text, fence]
