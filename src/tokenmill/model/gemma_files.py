"""What Gemma 2 / Gemma 3 files say, in either format: config keys, tensor names, the norm convention.

Kept apart from the generic loaders (hf_loader.py, gguf_loader.py), which call in here for these
architectures only:
- Hugging Face `config.json` (`gemma2`, `gemma3_text`): transformers 5's `rope_parameters` per layer
  type or the older `rope_theta` / `rope_local_base_freq` / `rope_scaling`, `layer_types` or the older
  `sliding_window_pattern`, and transformers' class defaults for what the file leaves out.
- GGUF (`general.architecture` gemma2 / gemma3): llama.cpp keeps the layer pattern, the sliding
  layers' RoPE theta and the attention scale in code, not metadata (llama-model.cpp's hparams for
  these architectures); they are repeated here.
- Norm weights: transformers computes x * (1 + w); llama.cpp's converter stores 1 + w. The model
  multiplies by the stored value, so the Hugging Face loader adds the 1 (exact in fp32: the same
  addition transformers makes at every call).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from tokenmill.errors import ModelLoadError
from tokenmill.model.config import ModelConfig
from tokenmill.model.gguf_metadata import read_gguf_metadata

# HF model_type / GGUF architecture -> registry key.
HF_MODEL_TYPES = {"gemma2": "gemma2", "gemma3_text": "gemma3"}
GGUF_ARCHITECTURES = {"gemma2": "gemma2", "gemma3": "gemma3"}
FAMILY = frozenset(HF_MODEL_TYPES.values())

# transformers 5 class defaults (Gemma2Config, Gemma3TextConfig) for keys a config.json may omit.
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": {
        "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6, "bos_token_id": 2, "eos_token_id": 1, "tie_word_embeddings": True,
        "query_pre_attn_scalar": 256, "sliding_window": 4096, "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0, "hidden_activation": "gelu_pytorch_tanh",
    },
    "gemma3_text": {
        "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6, "bos_token_id": 2, "eos_token_id": 1, "tie_word_embeddings": True,
        "query_pre_attn_scalar": 256, "sliding_window": 4096, "final_logit_softcapping": None,
        "attn_logit_softcapping": None, "hidden_activation": "gelu_pytorch_tanh",
    },
}
# Every `pattern`-th layer attends to the whole context, the others to a window (HF's
# `sliding_window_pattern`, llama.cpp's set_swa_pattern): gemma2 alternates, starting with a sliding one.
_PATTERN = {"gemma2": 2, "gemma3": 6}
_LOCAL_THETA = 10000.0  # gemma3's sliding layers (HF default `rope_local_base_freq`, llama.cpp's constant)
# Layer counts of the 27B models, whose attention scale is (hidden / heads) ** -0.5 (llama.cpp, from
# gemma_pytorch's config); every other size scales by head_dim ** -0.5.
_27B_LAYERS = {"gemma2": 46, "gemma3": 62}

# GGUF layer tensors whose HF names differ from the llama family's table (gguf_loader._LAYER_NAMES).
GGUF_LAYER_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def layer_pattern(arch: str, num_layers: int, pattern: int | None = None) -> tuple[str, ...]:
    every = pattern or _PATTERN[arch]
    return tuple("sliding_attention" if (i + 1) % every else "full_attention" for i in range(num_layers))


def hf_config(cfg: dict[str, Any], path: str, rope: Callable[[dict, int], tuple[float, dict | None]]) -> ModelConfig:
    """ModelConfig of a Gemma config.json (`rope` is hf_loader's reader of one RoPE parameter set)."""
    model_type = cfg["model_type"]
    arch = HF_MODEL_TYPES[model_type]
    cfg = {**_HF_DEFAULTS[model_type], **cfg}
    act = cfg.get("hidden_activation") or cfg.get("hidden_act")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelLoadError(path, f"unsupported hidden_activation {act!r} (gemma: gelu_pytorch_tanh)")
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError(path, "bidirectional attention (an embedding model) is not supported")
    layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or layer_pattern(arch, layers, cfg.get("sliding_window_pattern"))
    if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
        raise ModelLoadError(path, f"layer_types must name {layers} layers as sliding_attention / full_attention")
    max_pos = int(cfg["max_position_embeddings"])
    params = cfg.get("rope_parameters") or {}
    local_theta = None
    if "full_attention" in params:  # transformers 5: one parameter set per layer type
        theta, scaling = rope({**cfg, "rope_parameters": params["full_attention"]}, max_pos)
        local = params.get("sliding_attention") or {}
        local_theta = float(local.get("rope_theta", _LOCAL_THETA))
    else:
        theta, scaling = rope(cfg, max_pos)
        if arch == "gemma3":
            local_theta = float(cfg.get("rope_local_base_freq", _LOCAL_THETA))
    if arch == "gemma3" and "rope_theta" not in cfg and "rope_theta" not in params and "full_attention" not in params:
        theta = 1_000_000.0  # Gemma3TextConfig's global default, not llama's 10,000
    eos = cfg.get("eos_token_id")
    eos_ids = () if eos is None else tuple(int(t) for t in (eos if isinstance(eos, list) else [eos]))
    heads = int(cfg["num_attention_heads"])
    window = cfg.get("sliding_window")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        max_position_embeddings=max_pos,
        rms_norm_eps=float(cfg["rms_norm_eps"]),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(cfg["tie_word_embeddings"]),
        qk_norm=arch == "gemma3",
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        layer_types=tuple(types) if window else None,
        sliding_window=int(window) if window else None,
        rope_local_theta=local_theta,
        query_pre_attn_scalar=float(cfg["query_pre_attn_scalar"]),
        attn_logit_softcapping=_cap(cfg.get("attn_logit_softcapping")),
        final_logit_softcapping=_cap(cfg.get("final_logit_softcapping")),
    )


def hf_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Norm weights as the multiplier they act as (1 + w); everything else unchanged."""
    return {name: t + 1.0 if name.endswith("norm.weight") else t for name, t in weights.items()}


def gguf_config(config: ModelConfig, meta: Callable[[str], Any], arch: str, path: str) -> ModelConfig:
    """The generic GGUF config with Gemma's fields added (`meta(key)`: a metadata value or None)."""
    # llama.cpp ends generation on <end_of_turn> too (llama-vocab.cpp's end-of-generation texts),
    # which instruction-tuned Gemma files do not name in their metadata.
    tokens = read_gguf_metadata(path).get("tokenizer.ggml.tokens") or []
    end_of_turn = [i for i, text in enumerate(tokens) if text == "<end_of_turn>"]
    window = meta(f"{arch}.attention.sliding_window")
    heads_dim = config.hidden_size // config.num_heads
    scalar = heads_dim if config.num_layers == _27B_LAYERS[arch] else config.head_dim
    return dataclasses.replace(
        config,
        layer_types=layer_pattern(arch, config.num_layers) if window else None,
        sliding_window=int(window) if window else None,
        rope_local_theta=_LOCAL_THETA if arch == "gemma3" else None,
        query_pre_attn_scalar=float(scalar),
        attn_logit_softcapping=_cap(meta(f"{arch}.attn_logit_softcapping")),
        final_logit_softcapping=_cap(meta(f"{arch}.final_logit_softcapping")),
        eos_token_ids=tuple(dict.fromkeys([*config.eos_token_ids, *end_of_turn])),
    )


def extra_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Tensors a Gemma layer has beyond the llama family's (loader.expected_shapes)."""
    h = config.hidden_size
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(config.num_layers):
        shapes[f"model.layers.{i}.pre_feedforward_layernorm.weight"] = (h,)
        shapes[f"model.layers.{i}.post_feedforward_layernorm.weight"] = (h,)
    return shapes


def _cap(value: Any) -> float | None:
    # 0 means "off" in llama.cpp's metadata; None in transformers'.
    return float(value) if value else None
