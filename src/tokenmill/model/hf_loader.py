"""Reads a Hugging Face model folder: config.json into ModelConfig, *.safetensors into fp32 tensors."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors.torch import load_file

from tokenmill.errors import ModelLoadError
from tokenmill.model import gemma_files
from tokenmill.model.config import ModelConfig
from tokenmill.model.moe_config import MOE_MODEL_TYPES, moe_config_from_hf

# transformers 5 class defaults for the keys a config.json may leave out (save_pretrained omits some).
# They differ per model: mistral/qwen default to 8/32 kv heads and qwen3 to head_dim 128, not hidden/heads.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2},
    "mistral": {
        "max_position_embeddings": 4096 * 32,
        "num_key_value_heads": 8,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "qwen2": {"max_position_embeddings": 32768, "num_key_value_heads": 32},
    "qwen3": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "head_dim": 128},
    "qwen3_moe": {"max_position_embeddings": 32768, "num_key_value_heads": 4},
    "qwen2_moe": {"max_position_embeddings": 32768, "num_key_value_heads": 16},
    "mixtral": {"max_position_embeddings": 4096 * 32, "num_key_value_heads": 8, "bos_token_id": 1, "eos_token_id": 2},
}
SUPPORTED_MODEL_TYPES = tuple(sorted([*_DEFAULTS, *gemma_files.HF_MODEL_TYPES]))
_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
)
_INDEX = "model.safetensors.index.json"


def load_hf(folder: str) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    config = read_config(folder)
    weights: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(folder):
        try:
            tensors = load_file(file)
        except Exception as e:  # safetensors raises its own error types for bad headers / short files
            raise ModelLoadError(file, f"cannot read safetensors file ({type(e).__name__}: {e})") from e
        for name, tensor in tensors.items():
            # Old checkpoints saved the rope buffer; it is recomputed from the config.
            if name.endswith("rotary_emb.inv_freq"):
                continue
            # Some tied checkpoints store lm_head anyway (a copy of the embeddings); the model reuses the embeddings.
            if name == "lm_head.weight" and config.tie_word_embeddings:
                continue
            weights[name] = tensor.to(torch.float32).contiguous()
    if config.architecture in gemma_files.FAMILY:
        weights = gemma_files.hf_weights(weights)
    return config, weights


def read_config(folder: str) -> ModelConfig:
    path = os.path.join(folder, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except json.JSONDecodeError as e:
        raise ModelLoadError(path, f"invalid JSON ({e})") from e
    except OSError as e:
        raise ModelLoadError(path, f"cannot read config.json ({e.strerror})") from e
    if not isinstance(cfg, dict):
        raise ModelLoadError(path, "config.json is not a JSON object")
    model_type = cfg.get("model_type")
    if model_type in gemma_files.HF_MODEL_TYPES:
        return gemma_files.hf_config(cfg, path, _rope)
    if model_type not in _DEFAULTS:
        raise ModelLoadError(
            path, f"unsupported model_type {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    cfg = {**_DEFAULTS[model_type], **cfg}
    for key in _REQUIRED:
        if not isinstance(cfg.get(key), int):
            raise ModelLoadError(path, f"config.json needs an integer {key!r}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(path, f"unsupported hidden_act {cfg['hidden_act']!r} (only silu)")
    heads = cfg["num_attention_heads"]
    max_pos = cfg["max_position_embeddings"]
    theta, scaling = _rope(cfg, max_pos)
    dense_type = MOE_MODEL_TYPES.get(model_type, model_type)  # the attention a MoE model shares
    try:
        moe = moe_config_from_hf(model_type, cfg) if model_type in MOE_MODEL_TYPES else None
    except (ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(path, f"bad mixture-of-experts settings ({e})") from e
    eos = cfg.get("eos_token_id")
    eos_ids = () if eos is None else tuple(int(t) for t in (eos if isinstance(eos, list) else [eos]))
    return ModelConfig(
        architecture=model_type,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        # An explicit null means "same as num_attention_heads" (plain multi-head attention) in transformers.
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        max_position_embeddings=max_pos,
        rms_norm_eps=float(cfg.get("rms_norm_eps") or 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        # Qwen2Attention always has q/k/v biases; it has no attention_bias switch.
        attention_bias=dense_type == "qwen2" or bool(cfg.get("attention_bias", False)),
        qk_norm=dense_type == "qwen3",
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        moe=moe,
    )


def _rope(cfg: dict[str, Any], max_pos: int) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either transformers 5 `rope_parameters` or the older layout.

    transformers 5 writes `rope_parameters: {rope_type, rope_theta, ...}`; older files have a
    top-level `rope_theta` and a `rope_scaling` dict whose type key may be `type` instead of `rope_type`.
    """
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "type")}
    scaling["rope_type"] = rope_type
    if rope_type in ("llama3", "yarn", "longrope"):
        # transformers falls back to max_position_embeddings (or a top-level key) the same way.
        scaling.setdefault(
            "original_max_position_embeddings", cfg.get("original_max_position_embeddings", max_pos)
        )
    return theta, scaling


def _safetensors_files(folder: str) -> list[str]:
    index = os.path.join(folder, _INDEX)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(index, f"bad safetensors index ({type(e).__name__}: {e})") from e
    else:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if not names:
        raise ModelLoadError(
            folder, "no *.safetensors weights in the folder (other weight formats are not supported)"
        )
    files = [os.path.join(folder, n) for n in names]
    for file in files:
        if not os.path.isfile(file):
            raise ModelLoadError(file, f"no such file (listed in {_INDEX})")
    return files
