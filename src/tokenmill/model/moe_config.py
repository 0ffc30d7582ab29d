"""The mixture-of-experts hyper-parameters of a model (Qwen3-MoE, Qwen2-MoE, Mixtral), however the
file spells them: its own module so the loaders and the model can share it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int  # experts each token is routed to
    expert_intermediate_size: int
    # Whether the top-k routing weights are renormalised to sum to 1 (Mixtral always does).
    norm_topk_prob: bool = False
    # Qwen2-MoE: a dense expert every token goes through, scaled by sigmoid(x @ gate); 0: none.
    shared_expert_intermediate_size: int = 0
    # Layer i has experts when (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers.
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} must be in 1..num_experts ({self.num_experts})")

    def is_sparse(self, layer: int) -> bool:
        return (layer + 1) % self.decoder_sparse_step == 0 and layer not in self.mlp_only_layers


# HF model types with experts, and the dense family each one's attention follows.
MOE_MODEL_TYPES = {"qwen3_moe": "qwen3", "qwen2_moe": "qwen2", "mixtral": "mistral"}


def moe_config_from_hf(model_type: str, cfg: dict[str, Any]) -> MoEConfig:
    """From a config.json of one of MOE_MODEL_TYPES (transformers 5 writes num_local_experts for some)."""
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if not isinstance(experts, int) or experts < 1:
        raise ValueError("config.json needs an integer num_experts (or num_local_experts)")
    mixtral = model_type == "mixtral"
    return MoEConfig(
        num_experts=experts,
        top_k=int(cfg.get("num_experts_per_tok", 2)),
        # Mixtral's experts are intermediate_size wide; the Qwen MoEs' have their own width.
        expert_intermediate_size=int(cfg["intermediate_size"] if mixtral else cfg["moe_intermediate_size"]),
        norm_topk_prob=True if mixtral else bool(cfg.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0)
        if model_type == "qwen2_moe" else 0,
        decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
        mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
    )


def expert_weight_names(architecture: str, prefix: str, expert: int) -> tuple[str, str, str]:
    """(gate, up, down) of expert `expert` in layer `prefix`: Qwen-MoE's mlp.experts.N.{gate,up,down}_proj,
    Mixtral's block_sparse_moe.experts.N.{w1,w3,w2}."""
    if architecture == "mixtral":
        p = f"{prefix}block_sparse_moe.experts.{expert}."
        return p + "w1.weight", p + "w3.weight", p + "w2.weight"
    p = f"{prefix}mlp.experts.{expert}."
    return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"


def router_name(architecture: str, prefix: str) -> str:
    return f"{prefix}block_sparse_moe.gate.weight" if architecture == "mixtral" else f"{prefix}mlp.gate.weight"


def moe_shapes(moe: MoEConfig, architecture: str, prefix: str, hidden: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of one sparse layer's feed-forward block, with its shape."""
    ffn = moe.expert_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {router_name(architecture, prefix): (moe.num_experts, hidden)}
    for e in range(moe.num_experts):
        gate, up, down = expert_weight_names(architecture, prefix, e)
        shapes.update({gate: (ffn, hidden), up: (ffn, hidden), down: (hidden, ffn)})
    if moe.shared_expert_intermediate_size:
        s, n = f"{prefix}mlp.shared_expert.", moe.shared_expert_intermediate_size
        shapes.update({s + "gate_proj.weight": (n, hidden), s + "up_proj.weight": (n, hidden),
                       s + "down_proj.weight": (hidden, n), f"{prefix}mlp.shared_expert_gate.weight": (1, hidden)})
    return shapes
