"""What each head of a reward model scores: right and wrong, written-out and bare answers.

    python benchmarks/reward_heads.py <reward model dir> [--prompts 256] [--digits 2] [--verbose-share 0.7]

For the first `--prompts` held-out problems of the embedded addition task (`data.style=mixed`,
`--digits`-digit operands), four answers each: the written-out solution (`verbose`), the sum
alone (`concise`), and a wrong copy of each (the final answer's last digit moved by one). The
row is each head's mean score over the problems, as the learned-reward scorer computes it
(rewards/reward_model.py, logged in online RL as rewards/reward_model/<head>/mean). A head that
separates right from wrong scores the right rows well above the wrong ones in both forms; a
head that scores one form above the other whatever its verdict has learned the form.
"""

from __future__ import annotations

import argparse

from posttrain.data import arithmetic
from posttrain.data.sources import ArithmeticSource
from posttrain.rewards import ScoredSample
from posttrain.rewards.reward_model import RewardModelScorer


def answers(problem: arithmetic.Problem) -> dict[str, str]:
    """The four answers to one problem: right and wrong, verbose and concise."""
    verbose, concise = problem.solution("verbose"), problem.solution("concise")
    wrong_digit = str((problem.answer + 1) % 10)
    return {"right verbose": verbose, "right concise": concise,
            "wrong verbose": verbose[:-1] + wrong_digit, "wrong concise": concise[:-1] + wrong_digit}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reward_model", help="an hf_model directory of algorithm=reward_model")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--digits", type=int, default=2)
    parser.add_argument("--verbose-share", type=float, default=0.7)
    args = parser.parse_args()
    task = ArithmeticSource(min_digits=args.digits, max_digits=args.digits, style="mixed",
                            verbose_share=args.verbose_share)
    scorer = RewardModelScorer(path=args.reward_model)
    examples = [task.example("validation", i) for i in range(args.prompts)]
    problems = [arithmetic.Problem(tuple(map(int, e.prompt.rstrip("=").split("+")))) for e in examples]
    print(f"{'answer':<15}" + "".join(f"{head:>10}" for head in scorer.heads))
    for kind in answers(problems[0]):
        samples = [ScoredSample(e, answers(p)[kind], 1, truncated=False, group=i)
                   for i, (e, p) in enumerate(zip(examples, problems))]
        total = scorer(samples, task)
        means = scorer.take_metrics()  # each head's mean, where the model has several
        row = [means.get(f"rewards/reward_model/{head}/mean", float(total.mean())) for head in scorer.heads]
        print(f"{kind:<15}" + "".join(f"{mean:>10.2f}" for mean in row))


if __name__ == "__main__":
    main()
