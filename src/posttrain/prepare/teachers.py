"""The teacher of distillation algorithms (opd, kdrl, long2short), from the top-level `teacher` key:

    teacher: null                   # no teacher
    teacher: /path/to/hf_dir        # a Hugging Face model directory (config.json), as it is
    teacher: outputs/sft/runs/<t>   # a run directory: its hf_model/ export, else checkpoints/last.ckpt
    teacher: <run>/checkpoints/step000300.ckpt   # a Lightning checkpoint, exported to an HF directory
    teacher: tiny_concise           # an embedded recipe: a larger tiny model trained by SFT on the
    teacher: tiny_verbose           #   run's task in that solution style (teacher_recipe.*)

`resolve_teacher` turns it into an HF directory, written to `roles.teacher.name_or_path`, where
the algorithms build the teacher role from (models/roles.py). Whatever has to be made (an
export, an embedded teacher) is made once and cached under paths.cache_dir, with the SFT warm
start's machinery (warm_start.py: one job of a sweep and rank 0 of a job build it, the others
wait). Distillation compares the two models' distributions token by token, so the teacher's
tokenizer must be the policy's: the same token ids for the same tokens, the same special tokens.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from posttrain.conf import CONFIG_DIR
from posttrain.data.arithmetic import Problem
from posttrain.data.sources import build_source
from posttrain.errors import CheckpointError, ConfigError
from posttrain.models.loading import (_looks_like_path, check_tokenizer_files, first_line_of, load_tokenizer,
                                      load_tokenizer_and_model)
from posttrain.models.lora import export_model
from posttrain.prepare.cache import built_once, code_version
from posttrain.prepare.warm_start import Train, cached_sft_model, sft_plan
from posttrain.run.run_dir import find_weights, is_adapter_dir, load_from_adapter

# The embedded recipes and the solution style (data.style) each teacher is trained to write.
RECIPES = {"tiny_concise": "concise", "tiny_verbose": "verbose"}


def resolve_teacher(cfg: DictConfig, policy_tokenizer, train: Train) -> str | None:
    """The HF directory of `cfg.teacher` (made first if it is a checkpoint or a recipe), set as
    `roles.teacher.name_or_path` (init_from null); None when no teacher is configured. A
    teacher whose tokenizer is not `policy_tokenizer` is refused, naming the first token that differs.
    `train`: the recipe's `run`, which trains an embedded recipe."""
    teacher = cfg.get("teacher")
    if teacher is None:
        return None
    role = cfg.roles.teacher
    if role.get("name_or_path"):
        raise ConfigError(f"teacher={teacher!r} and roles.teacher.name_or_path={role.name_or_path!r} both name the "
                          f"teacher; set only `teacher`")
    directory = embedded_teacher(cfg, teacher, train) if teacher in RECIPES else teacher_directory(cfg, str(teacher))
    check_same_tokenizer(policy_tokenizer, load_teacher_tokenizer(directory, teacher), cfg, teacher, directory)
    with open_dict(cfg):
        role.name_or_path, role.init_from = directory, None
    return directory


# --- the embedded recipes -------------------------------------------------------------------

def embedded_teacher(cfg: DictConfig, recipe: str, train: Train) -> str:
    """Train (once: cached, like the SFT warm start) the embedded teacher `recipe`; its HF directory."""
    recipe_cfg, target = recipe_plan(cfg, recipe)
    # absolute: the run's config.yaml records where the teacher is, whatever the working directory
    return str(Path(cached_sft_model(recipe_cfg, target, f"Teacher {recipe}", train)).resolve())


def recipe_plan(cfg: DictConfig, recipe: str) -> tuple[DictConfig, Path]:
    """The SFT run that makes the embedded teacher `recipe`, and its cache directory: the
    embedded model (conf/model/tiny.yaml) with `teacher_recipe.model`'s overrides, on the run's
    task (data.*: digits, operands) in the recipe's solution style, with a response budget that
    fits the longest solution of that style. Its tokenizer is the embedded one of the task's
    alphabet, as the embedded policy's."""
    if cfg.data.source != "arithmetic":
        raise ConfigError(f"teacher={recipe!r} is trained on the embedded addition task, but data.source="
                          f"{cfg.data.source!r}; give teacher= a model directory or checkpoint instead")
    settings = cfg.teacher_recipe
    model = OmegaConf.load(Path(CONFIG_DIR) / "model" / "tiny.yaml")
    unknown = sorted(set(settings.model) - set(model))
    if unknown:
        raise ConfigError(f"teacher_recipe.model.{unknown[0]} is not a key of the embedded model "
                          f"(conf/model/tiny.yaml: {', '.join(model)})")
    base = cfg.copy()
    with open_dict(base):
        base.model = OmegaConf.merge(model, settings.model)
        base.data.style = RECIPES[recipe]
        base.data.max_response_tokens = longest_response_tokens(base.data)
        base.eval.max_new_tokens = base.data.max_response_tokens
    return sft_plan(base, settings, "teacher_recipe", "teacher")


def longest_response_tokens(data_cfg: DictConfig) -> int:
    """Tokens of the task's longest solution in data.style, plus its EOS: every operand all
    nines makes every column total, every carry and the sum as long as they can be (the
    embedded tokenizer has one token per character)."""
    nines = 10**data_cfg.max_digits - 1
    return len(Problem((nines,) * data_cfg.num_operands).solution(data_cfg.style)) + 1


# --- a model directory, a run or a checkpoint -----------------------------------------------

def teacher_directory(cfg: DictConfig, teacher: str) -> str:
    """The HF directory (absolute) of a teacher given as a path: an HF model directory as it is;
    a run directory's export or last checkpoint, or a checkpoint file, exported once into the
    cache (as posttrain-eval finds a run's model: run_dir.find_weights). A name that is no
    local path is a hub id, as model.name_or_path takes it."""
    path = Path(teacher).expanduser().resolve()
    if not path.exists():
        if not _looks_like_path(teacher):
            return teacher  # a hub id (its tokenizer is checked next, from the hub)
        raise ConfigError(f"teacher={teacher!r}: no such file or directory ({path}); give an HF model directory, "
                          f"a run directory, a Lightning checkpoint, or one of {', '.join(RECIPES)}")
    try:
        weights = find_weights(str(path))
    except CheckpointError as err:  # its message speaks of posttrain-eval's key: say it of ours
        raise ConfigError(f"teacher={teacher!r} is not a teacher model: {err}") from None
    if weights.is_hf_dir and not is_adapter_dir(weights.path):
        return str(weights.path)
    # the architecture and tokenizer: the run's (its config.yaml), else this run's model
    # settings, as posttrain-eval does for a checkpoint outside a run
    source_cfg = OmegaConf.load(weights.run_dir / "config.yaml") if weights.run_dir is not None else cfg
    model_cfg, data_cfg = source_cfg.model.copy(), source_cfg.data.copy()
    with open_dict(model_cfg):
        if weights.is_hf_dir:  # a LoRA adapter: its base with the adapter merged in
            load_from_adapter(model_cfg, weights.path)
        else:
            model_cfg.init_from = str(weights.path)
        if model_cfg.get("lora") is not None:
            model_cfg.lora.export_merged = True  # the teacher is one plain model
    return exported_teacher(cfg, teacher, weights.path, model_cfg, data_cfg)


def exported_teacher(cfg: DictConfig, teacher: str, weights: Path, model_cfg: DictConfig,
                     data_cfg: DictConfig) -> str:
    """`weights` (a checkpoint, an adapter) loaded into `model_cfg`'s model and exported to an HF
    directory, once: cached under a key of the weights' file (path, size, modification time),
    the model settings and the code."""
    stat = weights.stat()
    identity = f"{weights} {stat.st_size} {stat.st_mtime_ns}\n{OmegaConf.to_yaml(model_cfg)}\n{code_version()}"
    target = Path(cfg.paths.cache_dir) / "teacher" / f"export-{hashlib.sha256(identity.encode()).hexdigest()[:16]}"

    def export(scratch: Path) -> None:
        # the embedded tokenizer is built from the task's alphabet; a pretrained model has its own
        alphabet = build_source(data_cfg).alphabet if model_cfg.name_or_path is None else ""
        tokenizer, model = load_tokenizer_and_model(model_cfg, alphabet)
        export_model(model, tokenizer, scratch / "hf_model", model_cfg)

    return str(Path(built_once(target, export, f"Teacher {teacher}")).resolve())


# --- the tokenizer check --------------------------------------------------------------------

def load_teacher_tokenizer(directory: str, teacher: str):
    local = Path(directory).is_dir()
    if local:
        check_tokenizer_files(directory, "teacher", teacher)
    try:
        return load_tokenizer(directory)
    except (OSError, ValueError) as err:
        what = directory if local else (f"{directory} (no local path nor one of {', '.join(RECIPES)}: a hub id, and "
                                        f"the hub is unreachable or has no such model)")
        raise CheckpointError(f"teacher={teacher!r}: the tokenizer of {what} could not be loaded: "
                              f"{first_line_of(err)}") from None


# Special tokens whose ids must agree: generation stops at EOS, batches pad with PAD.
SPECIAL_TOKENS = ("eos_token", "pad_token", "bos_token", "unk_token")


def tokenizer_difference(policy_tokenizer, teacher_tokenizer) -> str | None:
    """The first difference between two tokenizers, in words, or None when they map every
    token to the same id and agree on the special tokens. A tokenizer without a pad token
    pads with its EOS (as models/loading.py loads it)."""
    ours, theirs = policy_tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
    for token, token_id in sorted(ours.items(), key=lambda item: item[1]):
        if theirs.get(token) != token_id:
            where = "absent" if token not in theirs else f"id {theirs[token]}"
            return f"token {token!r} is id {token_id} in the policy's tokenizer but {where} in the teacher's"
    for token, token_id in sorted(theirs.items(), key=lambda item: item[1]):
        if token not in ours:
            return f"token {token!r} (id {token_id}) of the teacher's tokenizer is absent from the policy's"
    for special in SPECIAL_TOKENS:
        own, other = special_token(policy_tokenizer, special), special_token(teacher_tokenizer, special)
        if own != other:
            return f"the {special} is {own!r} in the policy's tokenizer but {other!r} in the teacher's"
    return None


def special_token(tokenizer, special: str) -> str | None:
    token = getattr(tokenizer, special)
    if special == "pad_token" and token is None:
        return tokenizer.eos_token
    return token


def check_same_tokenizer(policy_tokenizer, teacher_tokenizer, cfg: DictConfig, teacher: str, directory: str) -> None:
    difference = tokenizer_difference(policy_tokenizer, teacher_tokenizer)
    if difference is None:
        return
    policy = cfg.model.name_or_path or "the embedded tiny model (model.name_or_path=null)"
    raise ConfigError(f"teacher={teacher!r} ({directory}) has another tokenizer than the policy ({policy}): "
                      f"{difference}. Distillation compares the two models token by token, so the teacher "
                      f"must share the policy's tokenizer")
