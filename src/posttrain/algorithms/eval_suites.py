"""Evaluation suites (`eval.suites`): several held-out sets, evaluated at each held-out
evaluation and by `posttrain-eval`, each with its own task, decoding and metrics.

    eval.suites={same: {samples: 1}, words: {data: word_problems, samples: 4, temperature: 1.0}}

A suite is a name and the options of SUITE_OPTIONS: `data` (null: the run's own task; a
conf/data option's name; or {source: <option>, <keys>}: that option's file with those keys
changed, e.g. a harder or an untrained task, to measure transfer and forgetting), `split`,
`num_prompts`, `samples` (1: greedy; k > 1: k responses per prompt sampled at `temperature`),
`max_new_tokens` and `metrics`. Its metrics are logged as `eval/<suite>/<metric>`:

- `accuracy`: the share of right responses (greedy: of the greedy ones; sampled: of all k per prompt)
- `response_len`: their mean length in tokens
- `pass@k`, `maj@k`, `mean@k` (k <= samples): per prompt from its `samples` responses, the
  expectation over k-subsets (core.pass_at_k, core/eval_metrics.py), averaged over prompts
- `<source>/accuracy`: `accuracy` over the examples of each `Example.source` (a mixture's
  source, a reasoning-gym task), when the suite's examples name one

Ranks keep in step: each takes its share of the suite's prompts (rank_share: the shares are
padded to one length with stand-ins that count for nothing), so every rank makes the same
generate calls; the sums of every suite are reduced with the held-out evaluation's own, in
one collective, and the names are the same on every rank (from the whole suite, not a rank's
share)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf

from posttrain.conf import CONFIG_DIR
from posttrain.core import pass_at_k
from posttrain.core.eval_metrics import majority_at_k, mean_at_k
from posttrain.core.options import (POSITIVE, Option, Spec, choice, either, integer, list_of, option_problems,
                                    optional, pattern, resolve_options, text)
from posttrain.data.arithmetic import SPLITS
from posttrain.data.datamodule import collate_prompts, fit_prompts
from posttrain.data.examples import judging_source
from posttrain.data.sources import build_source
from posttrain.distributed.collectives import rank_and_world, rank_share
from posttrain.errors import ConfigError, DataError
from posttrain.rollout import SamplingParams

SUITE_NAME = r"[A-Za-z0-9_.-]+"  # it becomes part of a metric's name: no '/'
# eval/<name>/... that the held-out evaluation logs itself (episodes, the reliability diagram, a
# reward model's pair rewards and heads, the samples table): no suite may take these names
EVAL_NAMESPACES = ("episode", "reliability", "rewards", "heads", "samples")
# accuracy, response_len, or pass@k / maj@k / mean@k with k >= 1
SUITE_METRIC = r"accuracy|response_len|(pass|maj|mean)@[1-9][0-9]*"
PER_PROMPT = {"pass": pass_at_k, "mean": mean_at_k}  # maj@k needs the answers too (majority_at_k)

DATA_NODE = Spec(lambda v: isinstance(v, dict) and isinstance(v.get("source"), str),
                 "a data node naming its source, e.g. {source: word_problems, max_steps: 2}")
SUITE_OPTIONS = (
    Option("data", None, optional(either(text(), DATA_NODE, expected="a conf/data option's name or a data node "
                                                                     "{source: <option>, <its keys>}")),
           "null: the run's own data; a name: conf/data/<name>.yaml; a node: that file with its keys changed"),
    Option("split", None, optional(choice(*SPLITS)), "null: eval.split"),
    Option("num_prompts", None, optional(integer(1)), "null: eval.num_prompts"),
    Option("samples", 1, integer(1), "responses per prompt: 1 greedy; k > 1 sampled at `temperature`"),
    Option("temperature", 1.0, POSITIVE, "samples > 1: the sampling temperature (with rollout.top_p, top_k)"),
    Option("max_new_tokens", None, optional(integer(1)),
           "null: the suite's data.max_response_tokens, else eval.max_new_tokens"),
    Option("metrics", None, optional(list_of(pattern(SUITE_METRIC, "accuracy, response_len, pass@k, maj@k or "
                                                                   "mean@k (k <= samples)"))),
           "null: accuracy and response_len, with samples k > 1 also pass@k, maj@k and mean@k"),
)


def suite_problems(name, given) -> list[str]:
    """A sentence per problem of suite `name` with the options `given` (a plain dict): its
    name, unknown keys, refused values, a metric's k above its samples."""
    owner = f"eval.suites.{name}"
    if not isinstance(given, dict):
        return [f"{owner}={given!r} is not valid: expected a mapping of the suite's options "
                f"({', '.join(option.name for option in SUITE_OPTIONS)})"]
    problems = []
    if not re.fullmatch(SUITE_NAME, str(name)):
        problems.append(f"eval.suites: the suite name {name!r} names its metrics (eval/<suite>/accuracy): use "
                        f"letters, digits, '_', '.' or '-'")
    if name in EVAL_NAMESPACES:
        problems.append(f"eval.suites: the suite name {name!r} is taken by the held-out evaluation's own "
                        f"eval/{name}/... metrics; the names {', '.join(EVAL_NAMESPACES)} are")
    problems += option_problems(owner, SUITE_OPTIONS, given)
    if problems:
        return problems
    data = given.get("data")
    option = data if isinstance(data, str) else None if data is None else data["source"]
    if option is not None and option not in data_options():
        problems.append(f"{owner}.data={data!r}: there is no data option {option!r}; the options are "
                        f"{', '.join(data_options())}")
    elif isinstance(data, dict):
        known = set(OmegaConf.load(Path(CONFIG_DIR) / "data" / f"{option}.yaml").keys())
        for key in sorted(set(data) - known):
            problems.append(f"{owner}.data.{key} is not a key of data={option} (conf/data/{option}.yaml): "
                            f"its keys are {', '.join(sorted(known))}")
    samples = given.get("samples", 1)
    if samples == 1 and "temperature" in given:
        problems.append(f"{owner}.temperature={given['temperature']!r} is read only with samples > 1: "
                        f"{owner}.samples=1 is one greedy response per prompt; drop the temperature or sample "
                        f"k > 1 responses")
    for metric in given.get("metrics") or []:
        k = metric_k(metric)
        if k is not None and k > samples:
            problems.append(f"{owner}.metrics asks for {metric}, but {owner}.samples={samples}: a metric at k "
                            f"reads k sampled responses per prompt, so it needs samples >= {k}")
    return problems


def data_options() -> list[str]:
    """The options of the data group (conf/data/<option>.yaml), which a suite's data names."""
    return sorted(path.stem for path in (Path(CONFIG_DIR) / "data").glob("*.yaml"))


def metric_k(metric: str) -> int | None:
    """The k of pass@k, maj@k, mean@k; None for accuracy and response_len."""
    return int(metric.split("@")[1]) if "@" in metric else None


def default_metrics(samples: int) -> tuple[str, ...]:
    if samples == 1:
        return ("accuracy", "response_len")
    return ("accuracy", f"pass@{samples}", f"maj@{samples}", f"mean@{samples}", "response_len")


@dataclass
class EvalSuite:
    """One suite, built: its task, its whole example set (the same on every rank), decoding, metrics."""

    name: str
    source: object
    examples: list
    samples: int
    sampling: SamplingParams
    metrics: tuple[str, ...]
    source_names: tuple[str, ...]  # the examples' Example.source values, sorted (none: an undivided task)

    def metrics_at_k(self) -> list[str]:
        """The metrics estimated per prompt (pass@k, maj@k, mean@k)."""
        return [m for m in self.metrics if metric_k(m) is not None]

    def sum_names(self) -> list[str]:
        """What this rank sums for the suite, in order: the same list on every rank."""
        by_source = [f"{name}/{what}" for name in self.source_names for what in ("correct", "responses")]
        return ["prompts", "responses", "correct", "length", *self.metrics_at_k(), *by_source]

    def metric_values(self, sums: torch.Tensor) -> dict[str, float]:
        """`eval/<suite>/<metric>` from the sums over every rank (`sum_names` order)."""
        totals = dict(zip(self.sum_names(), sums.tolist()))
        if totals["prompts"] == 0:
            return {}
        values = {"accuracy": totals["correct"] / totals["responses"],
                  "response_len": totals["length"] / totals["responses"]}
        values.update({m: totals[m] / totals["prompts"] for m in self.metrics_at_k()})
        out = {f"eval/{self.name}/{m}": values[m] for m in self.metrics}
        for name in self.source_names:
            if totals[f"{name}/responses"]:
                out[f"eval/{self.name}/{name}/accuracy"] = totals[f"{name}/correct"] / totals[f"{name}/responses"]
        return out


def suite_data_config(name: str, data, seed: int):
    """The data node of suite `name`'s `data` option (None: the run's own), with ${seed} the run's."""
    if data is None:
        return None
    option = data if isinstance(data, str) else data["source"]  # a known option: suite_problems checked it
    path = Path(CONFIG_DIR) / "data" / f"{option}.yaml"
    changes = {} if isinstance(data, str) else data
    node = OmegaConf.merge({"seed": seed}, {"data": OmegaConf.load(path)}, {"data": changes})
    return OmegaConf.create(OmegaConf.to_container(node, resolve=True)["data"])


def build_suites(eval_cfg, run_source, tokenizer, seed: int, top_p: float = 1.0, top_k: int = 0) -> list[EvalSuite]:
    """The suites of `eval_cfg.suites`, each checked (a ConfigError naming the key), its task
    built with the run's tokenizer and its prompts checked against the model's context."""
    suites = []
    given_suites = eval_cfg.get("suites") or {}
    for name in given_suites:
        node = given_suites[name]
        given = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
        problems = suite_problems(name, given)
        if problems:
            raise ConfigError("; ".join(problems))
        options = resolve_options(f"eval.suites.{name}", SUITE_OPTIONS, given)
        data_cfg = suite_data_config(name, options["data"], seed)
        # a preference source (it has pairs) holds its prompts in its task, as the datamodule reads it
        run_task = run_source.task if hasattr(run_source, "pairs") else run_source
        source = run_task if data_cfg is None else build_source(data_cfg)
        split = options["split"] or eval_cfg.get("split", "validation")
        wanted = options["num_prompts"] or eval_cfg.get("num_prompts", 256)
        size = source.size(split)
        count = wanted if size is None else min(size, wanted)
        fit_prompts(source, tokenizer, {split: count})  # too long for the model: an error here, before training
        examples = [source.example(split, i) for i in range(count)]
        if not examples:
            raise DataError(f"eval.suites.{name}: split {split!r} of its data has no examples to evaluate on")
        budget = (options["max_new_tokens"] or (data_cfg.get("max_response_tokens") if data_cfg is not None else None)
                  or eval_cfg.get("max_new_tokens"))
        samples = options["samples"]
        if samples == 1:
            sampling = SamplingParams(max_new_tokens=budget, greedy=True, temperature=0.0)
        else:
            sampling = SamplingParams(max_new_tokens=budget, temperature=options["temperature"], top_p=top_p,
                                      top_k=top_k)
        metrics = tuple(options["metrics"] or default_metrics(samples))
        names = tuple(sorted({e.source for e in examples if e.source is not None}))
        suites.append(EvalSuite(str(name), source, examples, samples, sampling, metrics, names))
    return suites


def final_answer(source, example, text: str):
    """The answer a response to `example` votes for in maj@k: the task's extracted final answer
    (None: none), or for a task that extracts none, the whole response stripped. In a mixture
    (data=mixture) the example's own source extracts it."""
    extract = getattr(judging_source(source, example), "final_answer", None)
    return extract(text) if extract is not None else text.strip()


def suite_sums(module, suite: EvalSuite, generate_and_score, generator: torch.Generator,
               rows_per_call: int) -> torch.Tensor:
    """This rank's sums for `suite` (EvalSuite.sum_names order), float64 on the CPU. Its share
    of the prompts, `suite.samples` responses each, about `rows_per_call` rows per generate
    call; whole prompts per call, so every rank makes ceil(share / prompts per call) calls.
    `generate_and_score`: the module's scorer (algorithms/base.py), judging by the suite's task."""
    n = suite.samples
    indices, counted = rank_share(len(suite.examples))
    prompts_per_call = max(1, rows_per_call // n)
    names = suite.sum_names()
    sums = dict.fromkeys(names, 0.0)
    for start in range(0, len(indices), prompts_per_call):
        examples = [suite.examples[i] for i in indices[start:start + prompts_per_call]]
        keep = counted[start:start + prompts_per_call]
        batch = collate_prompts([example for example in examples for _ in range(n)], module.tokenizer)
        batch.update({key: batch[key].to(module.device) for key in ("prompt_ids", "prompt_mask")})
        scored = generate_and_score(module, batch, suite.sampling, generator, source=suite.source)
        correct = torch.tensor(scored.correct, dtype=torch.float64).view(-1, n)
        lengths = torch.tensor(scored.lengths, dtype=torch.float64).view(-1, n)
        texts = scored.finals or scored.texts  # an episode votes with its last turn
        answers = [[final_answer(suite.source, examples[p], texts[p * n + j]) for j in range(n)]
                   for p in range(len(examples))]
        rows = [p for p, counts in enumerate(keep) if counts]
        if not rows:
            continue  # stand-ins only: generated to keep the ranks in step, counted nowhere
        correct, lengths, answers = correct[rows], lengths[rows], [answers[p] for p in rows]
        sums["prompts"] += len(rows)
        sums["responses"] += len(rows) * n
        sums["correct"] += float(correct.sum())
        sums["length"] += float(lengths.sum())
        for metric in suite.metrics_at_k():
            kind, k = metric.split("@")[0], metric_k(metric)
            if kind == "maj":
                sums[metric] += float(majority_at_k(answers, correct, k).sum())
            else:
                sums[metric] += float(PER_PROMPT[kind](n, correct.sum(dim=1), k).sum())
        for row, p in enumerate(rows):
            name = examples[p].source
            if name is not None:
                sums[f"{name}/correct"] += float(correct[row].sum())
                sums[f"{name}/responses"] += n
    return torch.tensor([sums[name] for name in names], dtype=torch.float64)


def suites_sums(module, suites: list[EvalSuite], generate_and_score, seed: int, rows_per_call: int) -> torch.Tensor:
    """Every suite's sums on this rank, concatenated (each suite's `sum_names` in turn). A
    sampled suite draws from its own generator, seeded from `seed`, the suite's place and the
    rank: the same draws at every evaluation, and training's random state untouched."""
    rank, world = rank_and_world()
    parts = []
    for index, suite in enumerate(suites):
        generator = torch.Generator(device=module.device).manual_seed((seed * 1000 + index) * world + rank)
        parts.append(suite_sums(module, suite, generate_and_score, generator, rows_per_call))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def suites_metrics(suites: list[EvalSuite], summed: torch.Tensor) -> dict[str, float]:
    """`eval/<suite>/<metric>` of every suite from `suites_sums` summed over the ranks."""
    metrics, start = {}, 0
    for suite in suites:
        width = len(suite.sum_names())
        metrics.update(suite.metric_values(summed[start:start + width].double().cpu()))
        start += width
    return metrics
