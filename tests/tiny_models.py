"""Tiny random-weight Hugging Face models (and GGUF conversions of them) for loader and model tests.

The vocabulary is SmolLM2's (49152) so the bundled tokenizer, saved into each folder, works with them.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from tokenmill.model.default_model import DEFAULT_MODEL_FILE, DEFAULT_MODEL_PACKAGE

ARCHS = ("llama", "llama3_tied", "mistral", "qwen2", "qwen3")
# Mixture-of-experts families (model/moe.py): 4 experts, 2 per token.
MOE_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral")
# The gemma family (model/gemma.py): a window of 8 tokens, so short test prompts already slide.
GEMMA_ARCHS = ("gemma2", "gemma3")
GEMMA_WINDOW = 8
VOCAB_SIZE = 49152
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    # With head_dim 16 these put two frequencies in the smoothed band, which the GGUF loader
    # needs to recover the parameters from llama.cpp's rope_freqs tensor.
    "high_freq_factor": 8.0,
    "original_max_position_embeddings": 128,
}
_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
_ARCH_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
    "llama3_tied": ("llama", {"tie_word_embeddings": True, "rope_parameters": LLAMA3_ROPE}),
    "mistral": (
        "mistral",
        {"sliding_window": None, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
    ),
    "qwen2": ("qwen2", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
    # head_dim != hidden / heads on purpose, as in real Qwen3 checkpoints.
    "qwen3": (
        "qwen3",
        {
            "head_dim": 32,
            "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        },
    ),
    # Layer 1 dense (mlp_only_layers), layer 0 with experts; experts unnormalised top-k.
    "qwen3_moe": (
        "qwen3_moe",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "mlp_only_layers": [1],
         "norm_topk_prob": False, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
    ),
    "qwen2_moe": (
        "qwen2_moe",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
         "shared_expert_intermediate_size": 64, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
    ),
    "mixtral": (
        "mixtral",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None,
         "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
    ),
    # head_dim != hidden / heads and query_pre_attn_scalar != head_dim, as each has its own use;
    # capping at small values so that tanh changes the numbers of O(1) scores and logits.
    "gemma2": (
        "gemma2",
        {
            "head_dim": 32,
            "query_pre_attn_scalar": 24,
            "sliding_window": GEMMA_WINDOW,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 3.0,
            "num_hidden_layers": 3,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
    "gemma3": (
        "gemma3_text",
        {
            "head_dim": 32,
            "query_pre_attn_scalar": 24,
            "sliding_window": GEMMA_WINDOW,
            "num_hidden_layers": 3,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        },
    ),
}

_tokenizer = None  # building it from the GGUF takes seconds: once per test process


def bundled_gguf() -> tuple[str, str]:
    """(directory, file name) of the bundled SmolLM2 GGUF, as transformers' `gguf_file=` wants them."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    assert spec is not None and spec.submodule_search_locations, f"{DEFAULT_MODEL_PACKAGE} is not installed"
    return list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE


def bundled_tokenizer() -> Any:
    global _tokenizer
    if _tokenizer is None:
        from tests.transformers_gguf import shared_gguf_parsing

        directory, name = bundled_gguf()
        with shared_gguf_parsing():
            _tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    return _tokenizer


def make_tiny_model(
    tmp_path: Path, arch: str, *, seed: int = 0, tokenizer: bool = True, **overrides: Any
) -> Path:
    """Save a tiny random model of `arch` (one of ARCHS) as a HF folder under tmp_path; return the folder.

    `overrides` replace config.json values (e.g. num_hidden_layers=3).
    """
    model_type, extra = _ARCH_CONFIGS[arch]
    config = AutoConfig.for_model(model_type, **{**_COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            # transformers initialises norms to 1 and biases to 0: a loader that forgot them would pass.
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn_like(param))
    folder = Path(tmp_path) / f"tiny-{arch}"
    model.save_pretrained(folder, safe_serialization=True)
    if tokenizer:
        bundled_tokenizer().save_pretrained(folder)
    return folder


def reference_model(folder: Path) -> PreTrainedModel:
    """The transformers model saved in `folder`, fp32, eval mode: the source of reference logits."""
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def reference_state_dict(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The model's tensors as tokenmill names them: lm_head only when not tied."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


# HF name -> GGUF name, for writing GGUF test files the way llama.cpp's converter does.
_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
# llama.cpp's names for gemma's four layer norms (the pre-MLP one is "ffn_norm" as in llama).
_GGUF_GEMMA_LAYER = {
    **_GGUF_LAYER,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def _gguf_name(hf_name: str, gemma: bool = False) -> str:
    if hf_name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{(_GGUF_GEMMA_LAYER if gemma else _GGUF_LAYER)[module]}.{kind}"


def _llamacpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    # convert_hf_to_gguf.py LlamaModel.permute: rows of each head go from (2, half) to (half, 2).
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llamacpp_rope_freqs(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    # convert_hf_to_gguf.py LlamaModel.generate_extra_tensors (Llama 3.x rope scaling).
    inv_freq = rope["rope_theta"] ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in inv_freq:
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


# gguf-py cannot quantize K-quant types; for these, tests get random blocks with small scales (the
# model's numbers are then not the HF model's: good for memory and dispatch tests only).
_RANDOM_K_QUANTS = {"Q4_K": (144, [(0, 0.002), (2, 0.001)]), "Q6_K": (210, [(208, 0.0005)])}


def _random_k_quant_blocks(kind: str, shape: tuple[int, int]) -> np.ndarray:
    size, fp16_fields = _RANDOM_K_QUANTS[kind]
    rows, cols = shape
    rng = np.random.default_rng(rows * 7919 + cols)
    blocks = rng.integers(0, 256, size=(rows * cols // 256, size), dtype=np.uint8)
    for offset, value in fp16_fields:
        blocks[:, offset : offset + 2] = np.full((len(blocks), 1), value, dtype=np.float16).view(np.uint8)
    return blocks.reshape(rows, cols // 256 * size)


def write_tiny_gguf(folder: Path, out: Path, quant: str | Callable[[str], str | None] | None = None,
                    dense_twin: Path | None = None, split_max_tensors: int = 0) -> Path:
    """Convert a tiny HF folder to GGUF like llama.cpp does (q/k permutation for llama, rope_freqs for llama3).

    Embeddings go in as F16 (exercising a non-F32 path), everything else as F32; with `quant`
    ("Q4_0", "Q4_1", "Q8_0"; "Q4_K" and "Q6_K" as random blocks) every matrix, the embedding
    included, is stored in that type instead. `quant` may also map each matrix's HF name to its type
    (a llama-quantize-like mix): types gguf-py cannot quantize get random blocks (tests/gguf_blocks.py)
    with the weights' spread, and "F16" / "BF16" / "F32" keep the values. `dense_twin` also writes the
    same model with every quantized matrix as its exact fp32 values (a file transformers can read
    when gguf-py cannot read a type of `out`). `split_max_tensors` splits `out` into parts of at most
    that many tensors, named as llama.cpp names them (OUT-00001-of-0000N.gguf; the first part returned).
    """
    import gguf

    from tests.gguf_blocks import QUANTIZABLE, random_blocks
    from tokenmill.model.quant_formats import dequantize_rows, format_of

    model = reference_model(folder)
    c = model.config
    arch = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
            "gemma3_text": "gemma3"}[c.model_type]
    gemma = arch.startswith("gemma")
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writers = [gguf.GGUFWriter(os.fspath(out), arch, split_max_tensors=split_max_tensors)]
    if dense_twin is not None:
        writers.append(gguf.GGUFWriter(os.fspath(dense_twin), arch))
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    for writer in writers:
        writer.add_block_count(c.num_hidden_layers)
        writer.add_context_length(c.max_position_embeddings)
        writer.add_embedding_length(c.hidden_size)
        writer.add_feed_forward_length(c.intermediate_size)
        writer.add_head_count(c.num_attention_heads)
        writer.add_head_count_kv(c.num_key_value_heads)
        writer.add_rope_freq_base(rope["rope_theta"])
        if gemma:
            writer.add_sliding_window(c.sliding_window)
            for key in ("attn_logit_softcapping", "final_logit_softcapping"):
                if getattr(c, key, None):
                    writer.add_float32(f"{arch}.{key}", getattr(c, key))
        writer.add_layer_norm_rms_eps(c.rms_norm_eps)
        writer.add_rope_dimension_count(head_dim)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_vocab_size(c.vocab_size)
        writer.add_bos_token_id(c.bos_token_id)
        writer.add_eos_token_id(c.eos_token_id)
        if rope.get("rope_type") == "llama3":
            writer.add_tensor("rope_freqs.weight", _llamacpp_rope_freqs(c.rope_parameters, head_dim))
    for name, tensor in reference_state_dict(model).items():
        w = tensor.numpy()
        if gemma and name.endswith("norm.weight"):
            w = w + 1.0  # convert_hf_to_gguf.py's Gemma models store the multiplier 1 + w
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            w = _llamacpp_permute(w, c.num_attention_heads if ".q_proj." in name else c.num_key_value_heads)
        kind = quant(name) if callable(quant) else quant
        if kind is not None and w.ndim == 2:
            qtype = gguf.GGMLQuantizationType.__members__.get(kind)
            if kind in _RANDOM_K_QUANTS and not callable(quant):
                data = _random_k_quant_blocks(kind, w.shape)
            elif kind in QUANTIZABLE or kind in ("F32", "F16", "BF16"):
                data = gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), qtype)
            else:
                seed = sum(map(ord, name))
                data = random_blocks(kind, *w.shape, seed=seed, std=float(w.std()))
            if qtype is None or qtype not in gguf.GGML_QUANT_SIZES:  # a type gguf-py cannot size: raw id, shape as is
                writers[0].add_tensor(_gguf_name(name, gemma), data.view(np.int8), raw_shape=w.shape,
                                      raw_dtype=format_of(kind).type_id)
            else:
                writers[0].add_tensor(_gguf_name(name, gemma), data, raw_shape=data.shape, raw_dtype=qtype)
            if dense_twin is not None:
                values = dequantize_rows(kind, data.reshape(w.shape[0], -1).view(np.uint8), w.shape[1]).numpy()
                writers[1].add_tensor(_gguf_name(name, gemma), np.ascontiguousarray(values))
            continue
        w = w.astype(np.float16) if name == "model.embed_tokens.weight" else w.astype(np.float32)
        for writer in writers:
            writer.add_tensor(_gguf_name(name, gemma), np.ascontiguousarray(w))
    for writer in writers:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    parts = writers[0].format_shard_names(Path(out))
    return parts[0]
