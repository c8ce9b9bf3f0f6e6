"""The train-inference mismatch's correction and budget (rollout.correction,
rollout.mismatch_budget). The mismatch itself (pi_old against the sampler's mu) is measured on
every batch by the policy term (`rollout/mismatch/*`); this part weighs each token's policy
loss by the configured correction (TIS, MIS) and counts, warns about or stops on a batch over
the budget. On only with a correction or a budget configured.
"""

from __future__ import annotations

import logging

from posttrain.algorithms.online.part import Part
from posttrain.distributed.collectives import rank_and_world
from posttrain.errors import MismatchError

log = logging.getLogger(__name__)

CORRECTION_KEYS = ("tis", "tis_cap", "mis", "mis_low", "mis_high")


def correction_of(rollout) -> dict:
    """The `rollout.correction` options that weigh the policy loss (core.correction_weights)."""
    correction = rollout.get("correction") or {}
    return {key: correction[key] for key in CORRECTION_KEYS if key in correction}


def budget_of(rollout) -> dict:
    """`rollout.mismatch_budget` with at least one ceiling set, else {}."""
    budget = dict(rollout.get("mismatch_budget") or {})
    return budget if any(budget.get(key) is not None for key in ("kl", "masked_frac")) else {}


class MismatchBudget(Part):
    name = "mismatch_budget"

    def __init__(self, budget: dict):
        self.budget = budget
        self.over_budget = 0  # rollout batches over the budget so far (checkpointed)

    def after_update(self, exp, metrics, step):
        """A batch whose mismatch KL or masked share (all-reduced, so every rank decides alike) is
        over its ceiling is counted, and warned about or stops the run. The count,
        `rollout/mismatch/over_budget_batches`, goes into summary.json, and posttrain-report marks
        a run with any such batch invalid."""
        ceilings = {"kl": self.budget.get("kl"), "masked_frac": self.budget.get("masked_frac")}
        over = [f"rollout/mismatch/{name} = {metrics[f'rollout/mismatch/{name}']:.4g} > {ceiling}"
                for name, ceiling in ceilings.items()
                if ceiling is not None and metrics.get(f"rollout/mismatch/{name}", 0.0) > ceiling]
        if over:
            self.over_budget += 1
            message = (f"rollout batch {step}: the sampler and the trainer disagree beyond rollout.mismatch_budget "
                       f"({'; '.join(over)})")
            if self.budget.get("action", "warn") == "stop":
                raise MismatchError(f"{message}; the run stops (rollout.mismatch_budget.action=stop)")
            if rank_and_world()[0] == 0:
                log.warning(f"{message}: the run is marked invalid (summary.json, posttrain-report)")
        metrics["rollout/mismatch/over_budget_batches"] = float(self.over_budget)

    def save(self, checkpoint):
        checkpoint["mismatch_over_budget"] = self.over_budget

    def load(self, checkpoint):
        self.over_budget = checkpoint.get("mismatch_over_budget", 0)
