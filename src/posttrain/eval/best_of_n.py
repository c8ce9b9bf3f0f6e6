"""Best-of-N by a process reward model in `posttrain-eval` (conf/evaluate.yaml, `best_of_n`).

    posttrain-eval checkpoint=<run> best_of_n.n=[1,4,16] best_of_n.prm=oracle
    posttrain-eval checkpoint=<run> best_of_n.prm=<algorithm=prm run>/hf_model best_of_n.orm=<reward_model run>/hf_model

For each held-out prompt, N = max(n) responses are sampled; each is split into steps (the
task's rule, data/steps.py), scored step by step by the PRM and once by the outcome reward
model (ORM), and judged by the task's verifier. Then, for each n, the held-out accuracy of
keeping one of n responses chosen by

    prm_last, prm_min, prm_product   the highest PRM score s_K, min_k s_k, prod_k s_k (Lightman et al. 2023)
    majority                         the most frequent final answer (self-consistency, Wang et al. 2023);
                                     the winning answer is as right as the share of its responses the
                                     verifier judged right (they can disagree: a verifier timeout)
    orm                              the highest ORM score
    oracle                           the verifier: pass@n, the ceiling of any selector
    random                           no selector: the accuracy of one sample

each the exact expectation over the n-subsets of the N responses (ties broken at random;
core.process), averaged over prompts. A selector earns its keep where it climbs from
random@n towards oracle@n as n grows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from rich.table import Table

from posttrain import core
from posttrain.core.eval_metrics import shared_answer_verdicts
from posttrain.core.options import is_int
from posttrain.data.examples import judging_source
from posttrain.data.steps import source_step_rule
from posttrain.errors import ConfigError
from posttrain.rewards.prm import ORACLE_SCORES, ProcessRewardModel, check_prm_dir, pad_steps
from posttrain.rewards.reward_model import RewardModelScorer, check_reward_model_dir
from posttrain.rewards.samples import rollout_samples

PRM_AGGREGATES = ("last", "min", "product")  # columns bon/prm_<how>@n (core.aggregate_step_scores)
METHODS = (*(f"prm_{how}" for how in PRM_AGGREGATES), "majority", "orm", "oracle", "random")  # table order


# --- config checks ----------------------------------------------

def subset_sizes(best_of_n) -> list[int]:
    """`best_of_n.n` as a sorted list of distinct positive ints ([] = best-of-N off)."""
    n = best_of_n.n
    if n is None:
        return []
    values = [n] if is_int(n) else n
    try:
        values = list(values)
    except TypeError:
        values = None
    if not values or not all(is_int(v) and v >= 1 for v in values):
        raise ConfigError(f"best_of_n.n={n!r} must be a list of positive integers (responses to choose from, "
                          f"e.g. [1,4,16]), or null to skip best-of-N")
    return sorted(set(values))


def check_best_of_n(cfg) -> list[int]:
    """Refuse a bad `best_of_n` node from the config alone; returns its sizes n ([] = off)."""
    best_of_n = cfg.best_of_n
    sizes = subset_sizes(best_of_n)
    if not sizes:
        return sizes

    if best_of_n.prm is not None and best_of_n.prm != "oracle":
        check_prm_dir(best_of_n.prm, "best_of_n.prm")
    if best_of_n.oracle_score not in ORACLE_SCORES:
        raise ConfigError(f"best_of_n.oracle_score={best_of_n.oracle_score!r} is not one of {list(ORACLE_SCORES)}")
    if best_of_n.orm is not None:
        check_reward_model_dir(best_of_n.orm, "best_of_n.orm")
    batch_size = best_of_n.prm_batch_size
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"best_of_n.prm_batch_size={batch_size!r} must be a positive integer")
    if not cfg.temperature > 0:
        raise ConfigError(f"temperature={cfg.temperature}: best-of-N samples max(best_of_n.n)={max(sizes)} "
                          f"responses per prompt, so it needs a temperature > 0")
    return sizes


def check_source_for_prm(best_of_n, source, data_source: str) -> None:
    """A PRM needs the task's step rule; the oracle PRM also its step verifier."""
    if best_of_n.prm is None:
        return
    source_step_rule(source)  # a ConfigError naming data.step_separators when unset
    if best_of_n.prm == "oracle" and not hasattr(source, "step_labels"):
        raise ConfigError(f"best_of_n.prm=oracle scores steps with the task's step verifier, but "
                          f"data.source={data_source!r} has none (no step_labels): score with a learned PRM, "
                          f"best_of_n.prm=<algorithm=prm run>/hf_model, or leave best_of_n.prm unset")


# --- sampling and judging ----------------------------------------------------------------------

@dataclass
class Judges:
    """What scores the responses besides the verifier: a PRM and an ORM, each optional."""

    prm: object | None = None  # rewards.prm.ProcessRewardModel
    orm: object | None = None  # rewards.reward_model.RewardModelScorer


def build_judges(best_of_n, policy) -> Judges:
    """The `best_of_n` node's PRM and ORM, run on the policy's device (loaded on first use)."""
    prm = orm = None
    if best_of_n.prm == "oracle":
        prm = ProcessRewardModel("oracle", oracle_score=best_of_n.oracle_score, key="best_of_n")
    elif best_of_n.prm is not None:
        prm = ProcessRewardModel("learned", path=best_of_n.prm, batch_size=best_of_n.prm_batch_size,
                                 policy=policy, key="best_of_n")
    if best_of_n.orm is not None:
        orm = RewardModelScorer(path=best_of_n.orm, batch_size=best_of_n.prm_batch_size, policy=policy)
    return Judges(prm, orm)


@dataclass
class Judged:
    """N sampled responses to each of P prompts, judged."""

    correct: torch.Tensor              # [P, N] 1.0 / 0.0 by the task's verifier
    answers: list[list[str | None]]    # [P][N] final answers (source.final_answer; None: none found)
    prm: dict[str, torch.Tensor]       # aggregate (PRM_AGGREGATES) -> [P, N] scores; {} without a PRM
    orm: torch.Tensor | None           # [P, N] outcome reward model scores; None without one

    @staticmethod
    def join(parts: list["Judged"]) -> "Judged":
        return Judged(correct=torch.cat([part.correct for part in parts]),
                      answers=[row for part in parts for row in part.answers],
                      prm={how: torch.cat([part.prm[how] for part in parts]) for how in parts[0].prm},
                      orm=None if parts[0].orm is None else torch.cat([part.orm for part in parts]))


def judge(samples, source, judges: Judges, num_prompts: int) -> Judged:
    """Verifier, final answers, PRM aggregates and ORM score of P x N samples (prompt-major)."""
    shape = (num_prompts, len(samples) // num_prompts)
    correct = torch.tensor([float(source.is_correct(s.example, s.response)) for s in samples]).view(shape)
    answers = [judging_source(source, s.example).final_answer(s.response) for s in samples]  # a mixture: its own
    answers = [answers[p * shape[1]:(p + 1) * shape[1]] for p in range(num_prompts)]
    prm = {}
    if judges.prm is not None:
        scores, valid = pad_steps(judges.prm.step_scores(samples, source))
        prm = {how: core.aggregate_step_scores(scores, valid, how).view(shape) for how in PRM_AGGREGATES}
    orm = None
    if judges.orm is not None:
        orm = torch.as_tensor(judges.orm(samples, source), dtype=torch.float32).cpu().view(shape)
    return Judged(correct, answers, prm, orm)


def sample_and_judge(module, batch: dict, params, num_samples: int, generator, judges: Judges) -> Judged:
    """`num_samples` responses to each prompt of `batch` (from `collate_prompts`), in one
    generate call, judged by `judge`."""
    n = num_samples
    rollout = module.generate(batch["prompt_ids"].repeat_interleave(n, dim=0),
                              batch["prompt_mask"].repeat_interleave(n, dim=0), params, generator=generator)
    examples = [example for example in batch["examples"] for _ in range(n)]
    rule = None if judges.prm is None else source_step_rule(module.source)  # steps: only a PRM reads them
    samples, _ = rollout_samples(module.tokenizer, rollout, examples, [i // n for i in range(len(examples))], rule)
    return judge(samples, module.source, judges, num_prompts=len(batch["examples"]))


# --- accuracies and their table ---------------------------------------------------------------------

def best_of_n_accuracies(judged: Judged, sizes: list[int], seed: int = 0) -> dict[str, float]:
    """`bon/<method>@<n>` for each n of `sizes`: held-out accuracy of each selector (module doc),
    the expectation over n-subsets of each prompt's N responses, averaged over prompts."""
    correct = judged.correct
    num_samples = correct.shape[1]
    generator = torch.Generator().manual_seed(seed)  # majority votes over many subsets are sampled
    results = {}
    for n in sizes:
        if n > num_samples:
            raise ConfigError(f"best_of_n.n: n={n} > {num_samples} responses sampled per prompt")
        for how, scores in judged.prm.items():
            results[f"bon/prm_{how}@{n}"] = float(core.best_of_n_expected_accuracy(scores, correct, n).mean())
        results[f"bon/majority@{n}"] = float(core.majority_vote_expected_accuracy(
            judged.answers, shared_answer_verdicts(judged.answers, correct), n, generator=generator).mean())
        if judged.orm is not None:
            results[f"bon/orm@{n}"] = float(core.best_of_n_expected_accuracy(judged.orm, correct, n).mean())
        results[f"bon/oracle@{n}"] = float(core.pass_at_k(num_samples, correct.sum(dim=1), n).mean())
        results[f"bon/random@{n}"] = float(correct.mean())
    return results


def best_of_n_table(results: dict[str, float], sizes: list[int], title: str):
    """A rich Table: a row per n, a column per method that has results."""
    methods = [m for m in METHODS if f"bon/{m}@{sizes[0]}" in results]
    table = Table(title=title)
    table.add_column("n", justify="right")
    for method in methods:
        table.add_column(method, justify="right")
    for n in sizes:
        table.add_row(str(n), *(f"{results[f'bon/{m}@{n}']:.1%}" for m in methods))
    return table
