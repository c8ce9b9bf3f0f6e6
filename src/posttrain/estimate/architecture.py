"""The models a run holds, from their configs alone: the embedded model built on the meta device
(no weights allocated), a pretrained one's config.json, and each role's parameters and bytes
per parameter on a device (memory.py's layout: fsdp shards, frozen roles' dtypes)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.core.cost import DecoderShape
from posttrain.errors import ConfigError
from posttrain.estimate.memory import (
    TRAINABLE_COPIES,
    layout_of,
    meta_parameter_count,
    model_config,
    model_directory,
    role_estimates,
)
from posttrain.models.loading import load_tokenizer
from posttrain.models.tiny import build_char_tokenizer, build_tiny_model
from posttrain.prepare.teachers import RECIPES


@dataclass(frozen=True)
class Role:
    """One model of the run on one device."""

    role: str
    model: str
    parameters: int
    shape: DecoderShape | None  # None: its architecture is not read (FLOPs not counted)
    weight_bytes: float         # bytes per parameter of its weights on this device
    trainable: bool


def shape_of(config) -> DecoderShape:
    """The decoder shape of a Hugging Face config."""
    heads = config.num_attention_heads
    return DecoderShape(layers=config.num_hidden_layers, hidden=config.hidden_size,
                        intermediate=config.intermediate_size, heads=heads,
                        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                        vocab=config.vocab_size)


def tiny_model(model_cfg, vocab_size: int):
    """The embedded model of `model_cfg`, built on the meta device (no weights allocated)."""
    with torch.device("meta"):
        return build_tiny_model(vocab_size=vocab_size, architecture=model_cfg.architecture,
                                hidden_size=model_cfg.hidden_size, num_layers=model_cfg.num_layers,
                                num_heads=model_cfg.num_heads, num_kv_heads=model_cfg.num_kv_heads,
                                intermediate_size=model_cfg.intermediate_size,
                                max_position_embeddings=model_cfg.max_position_embeddings,
                                tie_word_embeddings=model_cfg.tie_word_embeddings)


def pretrained_architecture(name_or_path: str, key: str):
    """(config, parameters, directory) of a pretrained model, from its config.json alone."""
    directory = model_directory(name_or_path)
    config = model_config(directory) if directory is not None else None
    parameters = meta_parameter_count(config) if config is not None else None
    if parameters is None:
        raise ConfigError(f"{key}={name_or_path!r}: its config.json cannot be read (a GGUF model is read once it "
                          f"has been converted: run it once)")
    return config, parameters, directory


def policy_architecture(cfg, alphabet) -> tuple[DecoderShape, int, object]:
    """(shape, parameters, tokenizer) of the policy: the embedded model's from its settings and
    the task's alphabet, a pretrained one's from its config.json and tokenizer files."""
    name = cfg.model.get("name_or_path")
    if name is None:
        tokenizer = build_char_tokenizer(alphabet, model_max_length=cfg.model.max_position_embeddings)
        model = tiny_model(cfg.model, len(tokenizer))
        return shape_of(model.config), sum(p.numel() for p in model.parameters()), tokenizer
    config, parameters, directory = pretrained_architecture(name, "model.name_or_path")
    return shape_of(config), parameters, load_tokenizer(directory)


def teacher_role(cfg, alphabet_vocab: int) -> tuple[str, int, DecoderShape] | None:
    """(model, parameters, shape) of the distillation teacher, or None when there is none."""
    teacher = cfg.get("teacher")
    named = cfg.roles.teacher.get("name_or_path") or teacher
    if named is None:
        return None
    if teacher in RECIPES:
        model_cfg = cfg.model.copy() if cfg.model.get("name_or_path") is None else None
        if model_cfg is None:
            return None
        for key, value in cfg.teacher_recipe.model.items():
            model_cfg[key] = value
        model = tiny_model(model_cfg, alphabet_vocab)
        return f"embedded {teacher}", sum(p.numel() for p in model.parameters()), shape_of(model.config)
    config, parameters, _ = pretrained_architecture(named, "teacher")
    return named, parameters, shape_of(config)


def model_roles(cfg, shape: DecoderShape, parameters: int, vocab: int) -> tuple[list[Role], list[str]]:
    """Every model the run holds on a device, with its bytes per parameter there (memory.py's
    layout: fsdp shards, frozen roles' dtypes), and notes on what is not counted."""
    layout = layout_of(cfg)
    notes = []
    roles = []
    for r in role_estimates(cfg, policy_parameters=parameters):
        per_parameter = r.bytes_per_parameter / memory_copies(r.trainable)
        same = r.parameters == parameters
        roles.append(Role(r.role, r.model, r.parameters, shape if same else None, per_parameter, r.trainable))
    if cfg.algorithm.get("kind") == "online":
        teacher = teacher_role(cfg, vocab)
        if teacher is not None:
            model, count, teacher_shape = teacher
            dtype = cfg.roles.teacher.get("dtype") or cfg.model.dtype
            frozen = layout.frozen("teacher", model, count, dtype)
            roles.append(Role("teacher", model, count, teacher_shape, frozen.bytes_per_parameter, False))
        for path in reward_model_paths(cfg):
            config, count, _ = pretrained_architecture(path, "reward.path")
            frozen = layout.frozen("reward model", path, count, cfg.model.dtype)
            roles.append(Role("reward model", path, count, shape_of(config), frozen.bytes_per_parameter, False))
            notes.append(f"reward model {path!r} counted as its causal LM (its score head as an LM head)")
    if cfg.model.get("lora", {}).get("r") is not None:
        notes.append("model.lora: the policy's base is frozen; the adapter's weights and AdamW state are left out")
    return roles, notes


def memory_copies(trainable: bool) -> int:
    """How many copies memory.py's bytes per parameter hold: weights, gradients and AdamW's two
    moments for a trainable role, the weights alone for a frozen one."""
    return TRAINABLE_COPIES if trainable else 1


def reward_model_paths(cfg) -> list[str]:
    components = (cfg.get("reward") or {}).get("components") or {}
    paths = []
    for component in components.values():
        if hasattr(component, "get") and (component.get("path") or component.get("paths")):
            paths += [component.path] if component.get("path") else list(component.paths)
    return paths
