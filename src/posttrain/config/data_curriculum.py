"""What `data_curriculum.*` accepts (conf/data_curriculum/: which prompts a rollout batch
draws), and the rule that a curriculum has what it reads."""

from __future__ import annotations

from posttrain.config.spec import PROBABILITY, Spec, Values, choice, integer, list_of, optional, rule
from posttrain.data.curriculum import CURRICULA

SPECS: dict[str, Spec] = {
    "data_curriculum.name": choice(*CURRICULA),
    "data_curriculum.max_extra_rounds": integer(0).about("extra generation rounds per step"),
    "data_curriculum.filter_on": choice("reward", "accuracy"),
    "data_curriculum.low": PROBABILITY.about("lowest pass rate kept"),
    "data_curriculum.high": PROBABILITY.about("highest pass rate kept"),
    "data_curriculum.pool_size": integer(1).about("prompts scored for their pass rate"),
    "data_curriculum.milestones": list_of(integer(1)).about("rollout batches at which the difficulty rises"),
    "data_curriculum.accuracy_threshold": optional(PROBABILITY),
    "data_curriculum.max_level": integer(0),
}


@rule
def curriculum_has_what_it_reads(v: Values):
    if not v.online():
        return
    name = v.get("data_curriculum.name", "none")
    if name == "pass_rate_filter" and v["data_curriculum.low"] > v["data_curriculum.high"]:
        yield (f"data_curriculum.low={v['data_curriculum.low']} is larger than "
               f"data_curriculum.high={v['data_curriculum.high']}; expected low <= high (the band of pass rates kept)")
    if name == "difficulty_schedule":
        if v.get("data.source") not in ("arithmetic", "word_problems"):
            yield ("data_curriculum=difficulty_schedule raises the task's difficulty, which only data=arithmetic "
                   f"and data=word_problems have (data.source={v.get('data.source')!r})")
        if not v.get("data_curriculum.milestones") and v.get("data_curriculum.accuracy_threshold") is None:
            yield ("data_curriculum=difficulty_schedule needs data_curriculum.milestones or "
                   "data_curriculum.accuracy_threshold, or it never changes anything")
    # correctness comes from the reward component named accuracy (rewards/composite.py)
    needs_accuracy = {
        "pass_rate_filter": "estimates pass rates",
        "dynamic_sampling": "filter_on=accuracy filters" if v.get("data_curriculum.filter_on") == "accuracy" else None,
        "difficulty_schedule": ("accuracy_threshold reads the training accuracy"
                                if v.get("data_curriculum.accuracy_threshold") is not None else None),
    }.get(name)
    components = v.get("reward.components")
    if needs_accuracy and isinstance(components, dict) and "accuracy" not in components:
        yield (f"data_curriculum={name} {needs_accuracy} from the reward's accuracy component, but "
               f"reward.components has none ({sorted(components)}); add reward.components.accuracy")
