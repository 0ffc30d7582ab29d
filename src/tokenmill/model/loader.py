"""Turns a model path (GGUF file or Hugging Face folder) into tensors with Hugging Face llama names.

Hugging Face tensors are fp32. GGUF matrices stay as the file holds them: quantized ones as
`GGUFWeight`s (rows of blocks, any type), F16 / BF16 ones 16-bit; model/layers decides per precision
what each runs as, so loading never makes an fp32 copy of a quantized model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

import torch

from tokenmill.errors import ModelLoadError
from tokenmill.model import gemma_files
from tokenmill.model.config import ModelConfig
from tokenmill.model.default_model import default_model_path
from tokenmill.model.gguf_loader import load_gguf, read_gguf_config
from tokenmill.model.gguf_metadata import GGUF_MAGIC
from tokenmill.model.hf_loader import load_hf, read_config
from tokenmill.model.moe_config import moe_shapes
from tokenmill.model.quant_formats import GGUFWeight


@dataclass
class LoadedWeights:
    config: ModelConfig
    # Hugging Face llama names; `lm_head.weight` only when embeddings are not tied. Tensors are
    # contiguous fp32 (16-bit for GGUF F16 / BF16 matrices); quantized GGUF matrices are GGUFWeights
    # (their `dequantize()` gives gguf-py's fp32 values).
    weights: dict[str, torch.Tensor | GGUFWeight]
    source: str
    kind: Literal["gguf", "hf"]
    # GGUF only: each tensor's type in the file ("Q4_1", "Q6_K", "F32", ...).
    gguf_types: dict[str, str] = field(default_factory=dict)


def load_weights(path: str | None) -> LoadedWeights:
    """Load a model: None means the bundled default, a GGUF file, or a folder with config.json + safetensors."""
    source = default_model_path() if path is None else os.path.expanduser(str(path))
    if not os.path.exists(source):
        raise ModelLoadError(source, "no such file or directory")
    if os.path.isdir(source):
        if not os.path.isfile(os.path.join(source, "config.json")):
            raise ModelLoadError(source, "not a GGUF file and not a folder with config.json")
        config, weights = load_hf(source)
        kind: Literal["gguf", "hf"] = "hf"
        types: dict[str, str] = {}
    elif source.lower().endswith(".gguf") or _has_gguf_magic(source):
        config, weights, types = load_gguf(source)
        kind = "gguf"
    else:
        raise ModelLoadError(source, "not a GGUF file and not a folder with config.json")
    check_weights(config, weights, source)
    return LoadedWeights(config=config, weights=weights, source=source, kind=kind, gguf_types=types)


def read_model_config(path: str | None) -> ModelConfig:
    """The model's hyper-parameters without loading its weights (for checks before a long load)."""
    source = default_model_path() if path is None else os.path.expanduser(str(path))
    if os.path.isdir(source):
        return read_config(source)
    return read_gguf_config(source)


def _has_gguf_magic(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, with its shape, as implied by the config."""
    h, hd = config.hidden_size, config.head_dim
    q, kv, ffn = config.num_heads * hd, config.num_kv_heads * hd, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q,)
            shapes[p + "self_attn.k_proj.bias"] = (kv,)
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
        if config.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        if config.moe is not None and config.moe.is_sparse(i):
            shapes.update(moe_shapes(config.moe, config.architecture, p, h))
            continue
        shapes[p + "mlp.gate_proj.weight"] = (ffn, h)
        shapes[p + "mlp.up_proj.weight"] = (ffn, h)
        shapes[p + "mlp.down_proj.weight"] = (h, ffn)
    if config.architecture in gemma_files.FAMILY:
        shapes.update(gemma_files.extra_shapes(config))
    return shapes


def check_weights(config: ModelConfig, weights: dict[str, torch.Tensor | GGUFWeight], source: str) -> None:
    """Refuse a checkpoint that does not match its config, before a matmul fails somewhere deep.

    Unexpected tensors are refused too (e.g. an o_proj or mlp bias): the model would silently ignore
    them and produce wrong text, which is worse than a clear error.
    """
    shapes = expected_shapes(config)
    for name in shapes:
        if name not in weights:
            raise ModelLoadError(source, f"missing tensor {name!r}")
    for name, tensor in weights.items():
        if name not in shapes:
            raise ModelLoadError(
                source,
                f"unexpected tensor {name!r}: tokenmill's {config.architecture} model has no use for it",
            )
        if tuple(tensor.shape) != shapes[name]:
            raise ModelLoadError(
                source, f"tensor {name!r} has shape {tuple(tensor.shape)}, the config implies {shapes[name]}"
            )
