"""What `teacher` and `teacher_recipe.*` accept (the frozen teacher of the distillation
algorithms, and the recipe of the embedded ones; conf/train.yaml), and the rule that a
teacher is there exactly when the algorithm distils from one."""

from __future__ import annotations

from posttrain.algorithms import rules
from posttrain.config.spec import POSITIVE, SEED, Spec, Values, anything, integer, mapping, number, optional, rule, text

SPECS: dict[str, Spec] = {
    "teacher": optional(text()).about("an HF directory, a checkpoint or run directory, or tiny_concise / tiny_verbose"),
    "teacher_recipe.model": mapping("{hidden_size: 256, num_layers: 4}").about("overrides of conf/model/tiny.yaml"),
    "teacher_recipe.model.hidden_size": integer(1),
    "teacher_recipe.model.num_layers": integer(1),
    "teacher_recipe.model.num_heads": integer(1),
    "teacher_recipe.model.intermediate_size": integer(1),
    # further keys of conf/model/tiny.yaml (+teacher_recipe.model.architecture=llama): checked
    # as model.<key> when the recipe's SFT run starts
    "teacher_recipe.model.*": anything(),
    "teacher_recipe.steps": integer(1).about("SFT steps, or their cap with until_accuracy"),
    "teacher_recipe.until_accuracy": optional(number(0, 1, low_open=True)).about("held-out greedy accuracy to "
                                                                                 "stop at; null: all steps"),
    "teacher_recipe.eval_every": integer(1).about("SFT steps between held-out evaluations"),
    "teacher_recipe.lr": POSITIVE.about("learning rate"),
    "teacher_recipe.batch_size": integer(1),
    "teacher_recipe.seed": SEED,
}


def teacher_keys(v: Values) -> list[str]:
    """The keys that configure a teacher, as `key=value`."""
    keys = ("teacher", "roles.teacher.name_or_path", "roles.teacher.init_from")
    return [f"{key}={v.get(key)}" for key in keys if v.get(key) is not None]


@rule
def distillation_reads_a_teacher(v: Values):
    """A distilling algorithm needs a teacher; a teacher no stage reads would be loaded (or
    trained) for nothing, and suggests the user meant another algorithm."""
    if not v.online():
        return

    algorithm = v.algorithm()
    distill = v.get("algorithm.distill")
    configured = teacher_keys(v)
    if problem := rules.teacher_problem(rules.distills(distill), bool(configured), f"algorithm={algorithm}"):
        yield problem
    elif configured and not rules.distills(distill):
        why = ("algorithm.distill.coef=0" if distill else "it has no algorithm.distill")
        yield (f"{' and '.join(configured)} is set, but algorithm={algorithm} does not read a teacher ({why}); drop "
               f"the teacher, or use algorithm=opd / kdrl, or set algorithm.distill.coef > 0")
