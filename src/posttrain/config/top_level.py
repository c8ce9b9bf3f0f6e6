"""What the top-level scalar keys of conf/train.yaml accept: seed, num_threads, host_mmap_threshold_kib, ckpt_path,
task_name, print_config. The file's nodes have files of their own: eval.py, roles.py,
teacher.py (teacher, teacher_recipe) and preference.py."""

from __future__ import annotations

from posttrain.config.spec import SEED, Spec, boolean, either, integer, optional, text

SPECS: dict[str, Spec] = {
    "seed": SEED,
    "num_threads": optional(integer(1)).about("torch threads on CPU; null: torch's default"),
    "host_mmap_threshold_kib": optional(integer(4)).about("CPU runs: allocations of at least this many KiB are "
                                                          "returned to the system when freed; null: glibc's default"),
    "ckpt_path": optional(text()).about("a Lightning checkpoint, 'last', or 'auto' (the run dir's newest intact "
                                         "checkpoint, if any)"),
    "task_name": either(text(), integer(), expected="a non-empty name").about("names the run directory"),
    "print_config": boolean(),
}
