"""Policy and tokenizer construction from the `model` config group."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from posttrain.errors import CheckpointError, ConfigError
from posttrain.models.tiny import build_char_tokenizer, build_tiny_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or os.sep == "\\" and "\\" in name


def _resolve_pretrained(name: str, key: str) -> str:
    """A local directory as an absolute path, or a hub id left as is."""
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"{key}={name!r} is a file; expected a Hugging Face model directory")
        return str(path.resolve())
    if _looks_like_path(name):
        raise CheckpointError(f"{key}={name!r}: no such directory")
    return name


def load_tokenizer_and_model(model_cfg, alphabet: str):
    """(tokenizer, policy) for the run: the embedded tiny model or a pretrained one."""
    if model_cfg.dtype not in DTYPES:
        raise ConfigError(f"model.dtype={model_cfg.dtype!r} is not one of {sorted(DTYPES)}")
    dtype = DTYPES[model_cfg.dtype]
    if model_cfg.name_or_path is None:
        tokenizer = build_char_tokenizer(alphabet)
        model = build_tiny_model(
            vocab_size=len(tokenizer),
            architecture=model_cfg.architecture,
            hidden_size=model_cfg.hidden_size,
            num_layers=model_cfg.num_layers,
            num_heads=model_cfg.num_heads,
            num_kv_heads=model_cfg.num_kv_heads,
            intermediate_size=model_cfg.intermediate_size,
            max_position_embeddings=model_cfg.max_position_embeddings,
            tie_word_embeddings=model_cfg.tie_word_embeddings,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        ).to(dtype)
    else:
        tokenizer, model = load_pretrained(model_cfg.name_or_path, "model.name_or_path", dtype)
    if model_cfg.get("init_from"):
        load_initial_weights(model, model_cfg.init_from)
    disable_dropout(model)
    return tokenizer, model


def _is_dropout_name(name: str) -> bool:
    return "dropout" in name or name.endswith("pdrop")  # attention_dropout, resid_pdrop, ...


def disable_dropout(model: nn.Module) -> nn.Module:
    """Switch every dropout off for good, in train() mode too (as TRL and torchtune do).

    The sampler runs in eval mode, so a training forward with dropout scores the sampled
    tokens under a different (noisy) policy: the PPO ratio is not 1 at the first step and
    the KL/ref terms are noisy.  Three places hold a rate: ``nn.Dropout`` modules, float
    attributes copied from the config at construction (HF attention keeps
    ``self.attention_dropout`` and calls ``F.dropout`` with it), and the config itself
    (read by modules built later, and saved with the checkpoint).  Returns ``model``.
    """
    from transformers import PretrainedConfig

    def zero_rates(obj) -> None:
        for name, value in list(vars(obj).items()):
            if _is_dropout_name(name) and isinstance(value, float):
                setattr(obj, name, 0.0)
            elif isinstance(value, PretrainedConfig):
                zero_rates(value)  # sub-configs (text_config, ...)

    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):  # Dropout, Dropout1d/2d/3d, AlphaDropout
            module.p = 0.0
        else:
            zero_rates(module)
    if isinstance(getattr(model, "config", None), PretrainedConfig):
        zero_rates(model.config)
    return model


def load_pretrained(name: str, key: str, dtype=torch.float32):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = _resolve_pretrained(name, key)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    except (OSError, ValueError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(
            f"{key}={name!r} could not be loaded as a Hugging Face causal LM "
            f"(not a local model directory, and the hub is unreachable or has no such model): {first_line}"
        ) from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # generation needs a pad id; EOS is the usual choice
    tokenizer.padding_side = "left"
    return tokenizer, model


def load_initial_weights(model, init_from: str, key: str = "model.init_from") -> None:
    """Start weights from a Lightning checkpoint (its `policy.*` tensors) or an HF directory;
    errors name the config ``key`` that pointed here."""
    path = Path(init_from).expanduser()
    if not path.exists():
        raise CheckpointError(f"{key}={init_from!r}: no such file or directory")
    if path.is_dir():
        from transformers import AutoModelForCausalLM

        state = AutoModelForCausalLM.from_pretrained(str(path), dtype=next(model.parameters()).dtype).state_dict()
    else:
        try:
            checkpoint = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as err:  # noqa: BLE001 - any unreadable file is the user's culprit
            raise CheckpointError(f"{key}={init_from!r} is not a readable checkpoint: {err}") from None
        state = {k[len("policy."):]: v for k, v in checkpoint.get("state_dict", {}).items() if k.startswith("policy.")}
        if not state:
            raise CheckpointError(f"{key}={init_from!r} holds no 'policy.*' weights")
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("lm_head.weight")]  # tied heads are not stored twice
    if missing or unexpected:
        raise CheckpointError(
            f"{key}={init_from!r} does not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
