"""Reads a llama.cpp GGUF file: metadata into ModelConfig, tensors with HF names.

Nothing is dequantized here. The file is memory-mapped and every quantized matrix, whatever its
type, comes back as a `GGUFWeight`: its rows of blocks, still the file's pages (the layer factory
turns each into what the precision runs, one at a time, and lets its pages go). F16 / BF16 matrices
stay 16-bit; F32 tensors and vectors (norms, biases) are copied as fp32.

Families differ in tensor names and in what llama.cpp's converter did to some tensors; both are
tables here (`ARCHITECTURES`, `_LAYER_NAMES`, `_TENSOR_FIXES`), so a family is a few entries.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from tokenmill.errors import ModelLoadError
from tokenmill.model import gemma_files, moe_files
from tokenmill.model.config import ModelConfig
from tokenmill.model.gguf_file import GGUFFile, SplitError, UnknownTensorType, read_gguf
from tokenmill.model.gguf_metadata import GGUF_MAGIC
from tokenmill.model.quant_formats import GGUFWeight, format_of

# GGUF `general.architecture` -> registry key. Mistral GGUFs say "llama": llama.cpp converts them as llama.
# Mixture-of-experts files: model/moe_files.py (a llama file with experts is mixtral).
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", **gemma_files.GGUF_ARCHITECTURES,
                 **moe_files.GGUF_ARCHITECTURES}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# One expert's matrix in the per-expert layout older Mixtral GGUF files have (blk.N.ffn_gate.E.weight).
_PER_EXPERT_TENSOR = re.compile(r"blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight")
# Llama 3.x GGUFs carry their rope scaling as per-frequency divisors rather than as metadata.
_ROPE_FREQS = "rope_freqs.weight"


Tensor = torch.Tensor | GGUFWeight


def load_gguf(path: str) -> tuple[ModelConfig, dict[str, Tensor], dict[str, str]]:
    """Config, weights, and the GGUF type name of every weight ("Q4_K", "F32", ...)."""
    _check_magic(path)
    try:
        reader = read_gguf(path)
    except UnknownTensorType as e:
        raise ModelLoadError(path, f"unsupported tensor type: {e}; re-quantize the model to a type "
                                   f"llama.cpp and gguf-py both know (e.g. Q4_K_M)") from e
    except SplitError as e:
        raise ModelLoadError(path, f"split GGUF: {e}") from e
    except Exception as e:  # the reader fails in many ways (struct, memmap, index) on a bad file
        raise ModelLoadError(path, f"corrupt or truncated GGUF file ({type(e).__name__}: {e})") from e
    arch = _meta(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise ModelLoadError(path, f"unsupported architecture {arch!r} (supported: {supported})")
    config = _config(reader, path, arch)
    weights: dict[str, Tensor] = {}
    types: dict[str, str] = {}
    rope_freqs = None
    for tensor in reader.tensors:
        kind, shape = tensor.kind, tensor.shape
        try:
            if tensor.name == _ROPE_FREQS:
                rope_freqs = dequantize(tensor.data, GGMLQuantizationType[kind]).reshape(shape)
                continue
            m = _LAYER_TENSOR.fullmatch(tensor.name)
            if config.moe is not None and m is not None and moe_files.is_expert_tensor(m.group(2)):
                experts = moe_files.split_experts(tensor.data, kind, shape, m.group(2), config.architecture,
                                                  f"model.layers.{m.group(1)}.", _read)
                weights.update(experts)
                types.update(dict.fromkeys(experts, kind))
                continue
            name = _hf_name(tensor.name, path, arch, config.architecture if config.moe else None)
            w = _read(tensor.data, kind, shape)
            for fix in _TENSOR_FIXES.get(arch, ()):
                w = fix(name, w, config)
        except ModelLoadError:
            raise
        except Exception as e:
            raise ModelLoadError(path, f"cannot read tensor {tensor.name!r} ({type(e).__name__}: {e})") from e
        weights[name] = w
        types[name] = kind
    if config.moe is not None:
        moe_files.fix_small_tensors(weights, config)
    if rope_freqs is not None:
        config = _with_llama3_scaling(config, rope_freqs, _meta(reader, f"{arch}.rope.dimension_count"), path)
    return config, weights, types


_SIXTEEN_BITS = {"F16": torch.float16, "BF16": torch.bfloat16}


def _read(data: np.ndarray, kind: str, shape: tuple[int, ...]) -> Tensor:
    """One tensor: a quantized matrix as its blocks (still the file's pages), a 16-bit matrix as a
    16-bit tensor, anything else fp32."""
    fmt = format_of(kind)
    raw = data.view(np.uint8)
    if len(shape) == 2 and fmt.quantized:
        return GGUFWeight(kind, raw.reshape(shape[0], fmt.row_bytes(shape[1])), shape)
    if len(shape) == 2 and kind in _SIXTEEN_BITS:
        return torch.from_numpy(np.array(raw)).view(_SIXTEEN_BITS[kind]).reshape(shape)
    array = dequantize(data, GGMLQuantizationType[kind]).reshape(shape)
    # F32 tensors come back as views of the read-only map: copy (torch wants writable memory that
    # outlives the map); fresh arrays pass as they are.
    return torch.from_numpy(np.require(array, np.float32, ["C_CONTIGUOUS", "WRITEABLE"]))


def _unpermute_qk(name: str, w: Tensor, config: ModelConfig) -> Tensor:
    """llama.cpp's llama converter interleaves the rows of q/k (to its rope layout); undo it. Its
    Qwen2/Qwen3 converters keep the HF layout, as transformers' GGUF loader assumes."""
    if ".q_proj." not in name and ".k_proj." not in name:
        return w
    heads = config.num_heads if ".q_proj." in name else config.num_kv_heads
    order = _unpermute_rows(np.arange(w.shape[0]), heads)
    if isinstance(w, GGUFWeight):  # whole rows of blocks move: lossless
        moved = w.rows(order)
        w.release()
        return moved
    return w[torch.from_numpy(order.copy())].contiguous()


# Per family, what to do to a tensor (HF name, tensor, config) after reading it.
_TENSOR_FIXES: dict[str, tuple[Callable[[str, Tensor, ModelConfig], Tensor], ...]] = {
    "llama": (_unpermute_qk,),
}


def read_gguf_config(path: str) -> ModelConfig:
    """The hyper-parameters alone, no tensor read (llama3 RoPE scaling, derived from a tensor, is
    left out): for checks made before the weights are loaded."""
    _check_magic(path)
    reader = read_gguf(path)
    return _config(reader, path, _meta(reader, "general.architecture"))


def _check_magic(path: str) -> None:
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelLoadError(path, f"cannot read file ({e.strerror})") from e
    if magic != GGUF_MAGIC:
        raise ModelLoadError(path, f"not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")


def _meta(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return reader.metadata.get(key, default)


def _hf_name(gguf_name: str, path: str, arch: str, moe_family: str | None = None) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_TENSOR.fullmatch(gguf_name)
    if moe_family is not None and m is not None:
        name = moe_files.layer_name(m.group(2), moe_family, f"model.layers.{m.group(1)}.")
        if name is not None:
            return f"{name}.{m.group(3)}"
    names = {**_LAYER_NAMES, **gemma_files.GGUF_LAYER_NAMES} if arch in gemma_files.GGUF_ARCHITECTURES else _LAYER_NAMES
    if m is None or m.group(2) not in names:
        if _PER_EXPERT_TENSOR.fullmatch(gguf_name):
            raise ModelLoadError(path, f"tensor {gguf_name!r} is one expert's matrix in the per-expert layout of "
                                       "older Mixtral GGUF files; tokenmill reads each layer's experts merged "
                                       "(ffn_gate_exps / ffn_up_exps / ffn_down_exps, as llama.cpp's "
                                       "convert_hf_to_gguf.py writes them): convert the model again")
        raise ModelLoadError(path, f"unexpected tensor {gguf_name!r}: tokenmill does not know what it is")
    return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"


def _unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    # llama.cpp stores each head's rows as (2, half) -> interleaved (half, 2); this swaps them back,
    # exactly like transformers' LlamaTensorProcessor._reverse_permute_weights. Works for biases too.
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _config(reader: GGUFFile, path: str, arch: str) -> ModelConfig:
    def need(key: str) -> Any:
        value = _meta(reader, f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(path, f"GGUF metadata has no {arch}.{key}")
        return value

    names = {t.name for t in reader.tensors}
    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = _meta(reader, f"{arch}.attention.key_length") or _meta(reader, f"{arch}.rope.dimension_count")
    vocab = _meta(reader, f"{arch}.vocab_size")
    if vocab is None:
        vocab = _meta(reader, "tokenizer.ggml.tokens")  # the vocabulary's length (gguf_file.py)
    if vocab is None:
        raise ModelLoadError(path, f"GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
    eos = [_meta(reader, f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
    config = ModelConfig(
        architecture=ARCHITECTURES[arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=int(_meta(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(head_dim or hidden // heads),
        max_position_embeddings=int(need("context_length")),
        rms_norm_eps=float(_meta(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(_meta(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(reader, arch),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        bos_token_id=_meta(reader, "tokenizer.ggml.bos_token_id"),
        # eot/eom: llama.cpp also stops generation on these (e.g. Llama 3 <|eot_id|>).
        eos_token_ids=tuple(dict.fromkeys(int(t) for t in eos if t is not None)),
    )
    if arch in gemma_files.GGUF_ARCHITECTURES:
        config = gemma_files.gguf_config(config, lambda key: _meta(reader, key), arch, path)
    if moe_files.family(arch, _meta(reader, f"{arch}.expert_count")) is not None:
        config = moe_files.gguf_config(config, lambda key: _meta(reader, key), arch, names, path)
    return config


def _rope_scaling(reader: GGUFFile, arch: str) -> dict[str, Any] | None:
    kind = _meta(reader, f"{arch}.rope.scaling.type")
    factor = _meta(reader, f"{arch}.rope.scaling.factor") or _meta(reader, f"{arch}.rope.scale_linear")
    if kind is None and factor:
        kind = "linear"  # old files only have rope.scale_linear
    if kind in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor or 1.0)}
    original = _meta(reader, f"{arch}.rope.scaling.original_context_length")
    if original:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _with_llama3_scaling(
    config: ModelConfig, rope_freqs: np.ndarray, rope_dim: int | None, path: str
) -> ModelConfig:
    """Recover HF llama3 rope parameters from llama.cpp's per-frequency divisors.

    The converter writes d = 1 (high frequencies), d = factor (low ones) and, in between,
    d = 1 / ((1 - s) / factor + s) with s = (old_ctx / wavelen - low) / (high - low), i.e. s is linear
    in 1 / wavelen. A line fit through the in-between points gives old_ctx / (high - low) and
    low / (high - low); only these ratios matter, so low = 1 (as in every Llama 3.x) fixes the rest.
    """
    d = rope_freqs.astype(np.float64).reshape(-1)
    factor = float(d.max())
    if factor <= 1.0:
        return config
    if config.rope_scaling is not None:
        raise ModelLoadError(path, "GGUF has both rope scaling metadata and a rope_freqs tensor")
    dim = int(rope_dim or config.head_dim)
    inv_freq = config.rope_theta ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    between = (d > 1.0 + 1e-5) & (d < factor - 1e-5 * factor)
    if len(inv_freq) != len(d) or between.sum() < 2:
        raise ModelLoadError(path, "cannot recover llama3 rope scaling from the rope_freqs tensor")
    s = (1.0 / d[between] - 1.0 / factor) / (1.0 - 1.0 / factor)
    slope, intercept = np.polyfit(inv_freq[between] / (2 * np.pi), s, 1)
    high = 1.0 - 1.0 / intercept
    scaling = {
        "rope_type": "llama3",
        "factor": round(factor, 4),
        "low_freq_factor": 1.0,
        "high_freq_factor": round(float(high), 4),
        "original_max_position_embeddings": int(round(float(slope * (high - 1.0)))),
    }
    return dataclasses.replace(config, rope_scaling=scaling)
