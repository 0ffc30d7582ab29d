"""Tiny mixture-of-experts GGUF files written the way llama.cpp's convert_hf_to_gguf.py + llama-quantize
lay them out, with the Hugging Face folder of the values the file holds (the reference).

Layout (checked against convert_hf_to_gguf.py's Qwen2MoeModel / LlamaModel output on the same tiny
folders): each layer's experts stacked per projection into `blk.N.ffn_{gate,up,down}_exps` of shape
[experts, rows, columns], the router `ffn_gate_inp` (kept F32: llama-quantize never quantizes it),
Qwen2-MoE's shared expert `ffn_{gate,up,down}_shexp` and its gate `ffn_gate_inp_shexp` [1, hidden];
Mixtral as a `llama` file with `llama.expert_count` and llama's q/k row permutation.

Each matrix is stored in the type `quant(hf_name)` gives: gguf-py quantizes the types it can, the
others get random blocks with the weights' spread (tests/gguf_blocks.py). The reference folder holds
gguf-py's dequantization of exactly those bytes, so transformers reading it computes what the file
says.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from tests.gguf_blocks import QUANTIZABLE, random_blocks
from tests.tiny_models import _llamacpp_permute

_GGUF_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}
_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_PROJ = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


def _encode(name: str, w: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """(the bytes of `w` in `kind`, gguf-py's fp32 values of those bytes)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    if kind in QUANTIZABLE or kind in ("F32", "F16", "BF16"):
        data = gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), qtype)
    else:
        data = random_blocks(kind, *w.shape, seed=sum(map(ord, name)), std=float(w.std()))
    return data, gguf.quants.dequantize(data, qtype).reshape(w.shape).astype(np.float32)


def write_moe_gguf(folder: Path, out: Path, quant: Callable[[str], str]) -> tuple[Path, Path]:
    """Write `folder` (a tiny HF MoE saved by tests/tiny_models.py) as GGUF at `out`, each matrix in
    the type `quant(hf_name)` names; return (the file, a HF folder holding the file's values)."""
    import gguf

    cfg = json.loads((folder / "config.json").read_text())
    model_type = cfg["model_type"]
    arch = _GGUF_ARCH[model_type]
    state = load_file(os.fspath(folder / "model.safetensors"))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    writer = gguf.GGUFWriter(os.fspath(out), arch)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    writer.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    if model_type != "mixtral":
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])

    reference: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, tuple[str, np.ndarray]]] = {}
    for name, tensor in state.items():
        w = tensor.float().numpy()
        if (m := _EXPERT.fullmatch(name)) is not None:
            experts.setdefault((int(m.group(1)), _PROJ[m.group(3)]), {})[int(m.group(2))] = (name, w)
            continue
        if name in _GLOBAL:
            gguf_name = _GLOBAL[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            module, suffix = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{_LAYER[module]}.{suffix}"
        permuted = arch == "llama" and (".q_proj." in name or ".k_proj." in name)
        if permuted:
            w = _llamacpp_permute(w, heads if ".q_proj." in name else kv_heads)
        kind = "F32" if w.ndim == 1 or "ffn_gate_inp" in gguf_name else quant(name)
        data, values = _encode(name, w, kind)
        if permuted:  # the reference gets the rows back in Hugging Face's order
            order = _llamacpp_permute(np.arange(w.shape[0]), heads if ".q_proj." in name else kv_heads)
            values = values[np.argsort(order)]
        reference[name] = torch.from_numpy(values.copy())
        writer.add_tensor(gguf_name, data, raw_shape=data.shape, raw_dtype=gguf.GGMLQuantizationType[kind])
    for (layer, proj), by_expert in sorted(experts.items()):
        kind = quant(by_expert[0][0])
        stacked = []
        for e in range(len(by_expert)):
            name, w = by_expert[e]
            data, values = _encode(name, w, kind)
            reference[name] = torch.from_numpy(values)
            stacked.append(data)
        data = np.stack(stacked)  # [experts, rows, row bytes]
        writer.add_tensor(f"blk.{layer}.ffn_{proj}_exps.weight", data, raw_shape=data.shape,
                          raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ref = out.with_suffix(".reference")
    ref.mkdir(exist_ok=True)
    shutil.copy(folder / "config.json", ref / "config.json")
    save_file({k: v.contiguous() for k, v in reference.items()}, os.fspath(ref / "model.safetensors"))
    return out, ref
