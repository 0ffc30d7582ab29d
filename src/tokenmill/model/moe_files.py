"""What llama.cpp's mixture-of-experts GGUF files say: metadata keys, tensor names, merged experts.

Kept apart from the generic GGUF loader (gguf_loader.py), which calls in here for these files only:
- Architectures: `qwen2moe` and `qwen3moe`; Mixtral is converted as `llama` with `llama.expert_count`
  (convert_hf_to_gguf.py registers MixtralForCausalLM as a llama model), so a llama file with experts
  becomes the `mixtral` family here.
- Metadata: `{arch}.expert_count`, `expert_used_count`, `expert_feed_forward_length` (the Qwen MoEs'
  expert width; Mixtral's experts are `feed_forward_length` wide), `expert_shared_feed_forward_length`
  (Qwen2-MoE's shared expert) and, where a converter wrote it, `expert_weights_norm`.
- Renormalised top-k: llama.cpp keeps it in code, not metadata (src/models/qwen2moe.cpp passes
  norm_w=false, qwen3moe.cpp and llama.cpp's Mixtral path true); the same table is here.
- Which layers have experts: a layer whose `ffn_gate_inp` (the router) is in the file; the others
  keep `ffn_gate` / `ffn_up` / `ffn_down` (Qwen3-MoE's `mlp_only_layers`).
- Tensors: llama.cpp stacks each layer's experts into one tensor per projection, [experts, rows,
  columns] (`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`). Each expert becomes a view of its slice
  of the file's map, named as Hugging Face names it (model/moe_config.py), so the model reads GGUF
  experts exactly as it reads a checkpoint's: nothing is copied here; the layer factory converts one
  expert at a time and drops its pages, as it does for a dense matrix.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tokenmill.errors import ModelLoadError
from tokenmill.model.config import ModelConfig
from tokenmill.model.moe_config import MoEConfig, expert_weight_names, router_name
from tokenmill.model.quant_formats import GGUFWeight

# GGUF architecture -> registry key ("llama" files with experts are mixtral: see family()).
GGUF_ARCHITECTURES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
# llama.cpp's norm_w per family (src/models/*.cpp), used when the file has no expert_weights_norm.
_NORM_TOPK = {"qwen2_moe": False, "qwen3_moe": True, "mixtral": True}
# Merged expert tensors: GGUF projection -> index into expert_weight_names' (gate, up, down).
_EXPERT_TENSORS = {"ffn_gate_exps": 0, "ffn_up_exps": 1, "ffn_down_exps": 2}
# Layer tensors of the routed block besides the experts, with their Hugging Face names (Qwen's; the
# router of Mixtral is renamed by router_name).
LAYER_NAMES = {
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_ROUTER = "ffn_gate_inp"

Read = Callable[[np.ndarray, str, tuple[int, ...]], "torch.Tensor | GGUFWeight"]


def family(arch: str, expert_count: Any) -> str | None:
    """The registry key of a MoE file (`expert_count`: its `{arch}.expert_count`), or None for a dense one."""
    if arch in GGUF_ARCHITECTURES:
        return GGUF_ARCHITECTURES[arch]
    if arch == "llama" and isinstance(expert_count, int) and expert_count > 0:
        return "mixtral"
    return None


def gguf_config(config: ModelConfig, meta: Callable[[str], Any], arch: str, tensor_names: set[str],
                path: str) -> ModelConfig:
    """`config` (read as for a dense file) with the family's key and its MoEConfig."""
    key = family(arch, meta(f"{arch}.expert_count"))
    assert key is not None
    experts, used = meta(f"{arch}.expert_count"), meta(f"{arch}.expert_used_count")
    if not isinstance(experts, int) or not isinstance(used, int):
        raise ModelLoadError(path, f"GGUF metadata needs integer {arch}.expert_count and {arch}.expert_used_count")
    width = meta(f"{arch}.expert_feed_forward_length") if key != "mixtral" else config.intermediate_size
    if width is None:
        raise ModelLoadError(path, f"GGUF metadata has no {arch}.expert_feed_forward_length")
    norm = meta(f"{arch}.expert_weights_norm")
    shared = 0
    if key == "qwen2_moe":
        shared = int(meta(f"{arch}.expert_shared_feed_forward_length") or 0)
    dense = tuple(i for i in range(config.num_layers) if f"blk.{i}.{_ROUTER}.weight" not in tensor_names)
    try:
        moe = MoEConfig(num_experts=experts, top_k=used, expert_intermediate_size=int(width),
                        norm_topk_prob=_NORM_TOPK[key] if norm is None else bool(norm),
                        shared_expert_intermediate_size=shared, mlp_only_layers=dense)
    except ValueError as e:
        raise ModelLoadError(path, f"bad mixture-of-experts settings ({e})") from e
    return dataclasses.replace(config, architecture=key, moe=moe)


def is_expert_tensor(kind: str) -> bool:
    """Whether a layer tensor kind ("ffn_up_exps", ...) is one of the merged expert stacks."""
    return kind in _EXPERT_TENSORS


def layer_name(kind: str, architecture: str, prefix: str) -> str | None:
    """The Hugging Face name (without .weight) of a routed block's non-expert tensor, else None."""
    if kind == _ROUTER:
        return router_name(architecture, prefix).removesuffix(".weight")
    name = LAYER_NAMES.get(kind)
    return None if name is None else prefix + name


def split_experts(data: np.ndarray, kind: str, shape: tuple[int, ...], projection: str, architecture: str,
                  prefix: str, read: Read) -> dict[str, torch.Tensor | GGUFWeight]:
    """One merged [experts, rows, columns] tensor as one weight per expert, each read from its own
    slice of `data` (`read` is the loader's reader of one matrix: a quantized slice stays a view)."""
    if len(shape) != 3 or data.nbytes % shape[0]:
        raise ValueError(f"expected [experts, rows, columns], got {list(shape)}")
    raw = data.view(np.uint8)
    size = raw.nbytes // shape[0]
    which = _EXPERT_TENSORS[projection]
    return {expert_weight_names(architecture, prefix, e)[which]: read(raw[e * size:(e + 1) * size], kind, shape[1:])
            for e in range(shape[0])}


def fix_small_tensors(weights: dict[str, Any], config: ModelConfig) -> None:
    """Routers and the shared expert's gate as the model takes them: fp32 [rows, hidden] (llama.cpp
    stores the gate as a vector; a file may hold either in a 16-bit or quantized type)."""
    hidden = config.hidden_size
    for name, w in list(weights.items()):
        if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight", "mlp.shared_expert_gate.weight")):
            dense = w.dequantize() if isinstance(w, GGUFWeight) else w.float()
            weights[name] = dense.reshape(-1, hidden).contiguous()
