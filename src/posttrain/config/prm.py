"""What `prm.*` accepts (conf/prm/: the process reward model reward=prm reads, an oracle or a
learned one)."""

from __future__ import annotations

from posttrain.config.spec import Spec, choice, integer, optional, text

SPECS: dict[str, Spec] = {
    "prm.model": choice("oracle", "learned").about("oracle: the task's step verifier | learned: an algorithm=prm export"),
    "prm.path": optional(text()).about("the hf_model/ of an algorithm=prm run (prm=learned)"),
    "prm.oracle_score": choice("prefix", "step").about("prefix: 1 while every step so far is right | step: each alone"),
    "prm.batch_size": integer(1).about("rows per PRM forward"),
}
