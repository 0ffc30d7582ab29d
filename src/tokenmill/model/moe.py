"""Mixture-of-experts decoders (Qwen3-MoE, Qwen2-MoE with its gated shared expert, Mixtral): the
llama family's attention with a routed feed-forward block in the layers the config names.

Routing is the reference's: softmax over the router's logits in fp32, top-k, renormalised where the
config says (`norm_topk_prob`; Mixtral always), ties broken as torch.topk breaks them (transformers
calls the same). A step's tokens are grouped by expert (one stable sort of the flat assignments), so
each active expert runs ONE linear pair over all of its tokens; the weighted outputs are added back
per expert in ascending expert order, the order transformers adds them in, so fp32 sums agree.
Experts are ordinary linears (layers/factory.py), so they run in whatever form the policy gives
(fp32, bf16 GEMMs, int8/int4 kernels) and a quantized expert is read only by the steps that route to it.
In fast mode, blocked experts run one expert a thread in one C++ call (kernels/moe_experts.py), with
the same numbers as op by op.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from tokenmill.model.config import ModelConfig
from tokenmill.model.kernels import fused_ops, moe_experts
from tokenmill.model.layers.factory import LayerPolicy, make_linear
from tokenmill.model.layers.quantized_linear import QuantizedLinear, gated_silu
from tokenmill.model.llama import DecoderLayer, LlamaForCausalLM
from tokenmill.model.moe_config import expert_weight_names, router_name
from tokenmill.model.quant import BlockedWeight


def threads_share_experts(counts: list[int]) -> bool:
    """Whether a step's experts (rows per expert) keep every thread busy when each runs whole experts:
    at least two active experts a thread, and none so large that its thread would carry more than
    1.5 threads' fair share (else each expert's linears split their columns between the threads)."""
    active = [c for c in counts if c]
    threads = torch.get_num_threads()
    return len(active) >= 2 * threads and max(active) * threads <= 1.5 * sum(active)


def bind_experts(experts: list[Expert]) -> moe_experts.BoundExperts | None:
    """The experts as the threaded op takes them, or None where it cannot run them: no op here, or an
    expert linear that is not one blocked weight on the kernel at every row count (a dense GEMM from
    some rows, a bias, parts in different formats)."""
    if not moe_experts.available():
        return None
    linears = [lin for e in experts for lin in (e.gate_up, e.down)]
    if not all(isinstance(lin, QuantizedLinear) and lin.kernel_at_any_rows and isinstance(lin.weight, BlockedWeight)
               for lin in linears):
        return None
    return moe_experts.BoundExperts([e.gate_up.weight for e in experts], [e.down.weight for e in experts])


class Expert:
    """One gated SiLU MLP (gate and up fused into one GEMM)."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, policy: LayerPolicy) -> None:
        self.gate_up = make_linear([gate, up], None, policy)
        self.down = make_linear([down], None, policy)

    def __call__(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """`fused`: SiLU(gate) * up in one pass (fast mode's fused op), else transformers' two ops."""
        if fused:
            return self.down(gated_silu(self.gate_up, x))
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class SparseMoE:
    def __init__(self, config: ModelConfig, weights: dict, prefix: str, policy: LayerPolicy) -> None:
        assert config.moe is not None
        self.moe = moe = config.moe
        router = weights[router_name(config.architecture, prefix)]
        # The router stays fp32 in every precision: its logits pick experts, and a rounding that
        # flips a near-tie sends the token through other weights altogether.
        self.router = router.float().contiguous()
        self.experts = [Expert(*(weights[n] for n in expert_weight_names(config.architecture, prefix, e)), policy)
                        for e in range(moe.num_experts)]
        self.shared: Expert | None = None
        self.shared_gate: torch.Tensor | None = None
        if moe.shared_expert_intermediate_size:
            s = f"{prefix}mlp.shared_expert."
            self.shared = Expert(weights[s + "gate_proj.weight"], weights[s + "up_proj.weight"],
                                 weights[s + "down_proj.weight"], policy)
            self.shared_gate = weights[f"{prefix}mlp.shared_expert_gate.weight"].float().contiguous()
        self.bound = bind_experts(self.experts)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, expert ids [T, k])."""
        logits = F.linear(x.float(), self.router)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top_w, top_i = torch.topk(probs, self.moe.top_k, dim=-1)
        if self.moe.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return top_w.to(x.dtype), top_i

    def __call__(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        top_w, top_i = self.route(x)
        k = self.moe.top_k
        flat = top_i.reshape(-1)
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert, tokens in order
        counts = torch.bincount(flat, minlength=self.moe.num_experts).tolist()
        tokens = order // k
        weights = top_w.reshape(-1)[order, None]
        if fused and self.bound is not None and x.dtype == torch.float32 and threads_share_experts(counts):
            # whole experts a thread (kernels/moe_experts.py): the op-by-op path's numbers, 1.5-5x faster
            out = self.bound(x, tokens, weights.reshape(-1), counts)
        else:
            out = self.experts_op_by_op(x, tokens, weights, counts, fused)
        if self.shared is not None:
            gate = torch.sigmoid(F.linear(x.float(), self.shared_gate)).to(x.dtype)
            out = out + gate * self.shared(x, fused)
        return out

    def experts_op_by_op(self, x: torch.Tensor, tokens: torch.Tensor, weights: torch.Tensor, counts: list[int],
                         fused: bool) -> torch.Tensor:
        out = torch.zeros_like(x)
        start = 0
        for expert, count in zip(self.experts, counts):
            if count:
                end = start + count
                rows = tokens[start:end]
                # rows gathered by index_select (advanced indexing's generic gather took 88 against
                # 62 ms of a 16 x 115-token MoE prompt step); weighted and added to its tokens' rows
                # in ascending expert order, as transformers adds them: fast mode in one pass (the
                # same numbers), else weighted in place while in cache, then index_add_
                y = expert(x.index_select(0, rows), fused)
                if fused and out.dtype == torch.float32:
                    fused_ops.weighted_index_add_(out, rows, y, weights[start:end])
                else:
                    out.index_add_(0, rows, y.mul_(weights[start:end]).to(out.dtype))
                start = end
        return out

    def linears(self) -> list:
        parts = [p for e in self.experts for p in (e.gate_up, e.down)]
        if self.shared is not None:
            parts += [self.shared.gate_up, self.shared.down]
        return parts


class MoEDecoderLayer(DecoderLayer):
    """A llama-family layer whose feed-forward block is a SparseMoE."""

    def _init_mlp(self, config: ModelConfig, weights: dict, prefix: str, policy: LayerPolicy) -> None:
        self.moe_block = SparseMoE(config, weights, prefix, policy)
        # What makes the block's output whole: nothing on one rank; with tensor parallelism every
        # expert holds a slice of its width and this is the all-reduce of the partial sums.
        self.combine: Callable[[torch.Tensor], torch.Tensor] | None = None

    def mlp(self, h: torch.Tensor, fused: bool = False) -> torch.Tensor:
        out = self.moe_block(h, fused)
        return out if self.combine is None else self.combine(out)

    def mlp_fused(self, h: torch.Tensor) -> torch.Tensor:
        # Steps of many rows hand the MLP bf16 rows (a dense MLP's GEMMs run bf16 there), but each
        # expert sees only its share of them, few enough for the packed kernel, which takes fp32.
        return self.mlp(h.float(), fused=True).to(h.dtype)

    def bf16_start(self) -> int | None:
        # The experts see their share of a step's rows, mostly on the packed kernel in float32: bf16
        # activations only where their GEMMs round to bf16 anyway (not where only the tiles would).
        experts = {part.bf16_from_rows if isinstance(part, QuantizedLinear) else None for part in self.moe_block.linears()}
        start = super().bf16_start()
        return start if experts == {start} else None

    def mlp_parts(self) -> dict[str, object]:
        first = self.moe_block.experts[0]
        return {"expert gate_up": first.gate_up, "expert down": first.down}

    def linears(self) -> list:
        return [self.qkv, self.o_proj, *self.moe_block.linears()]

    @property
    def router(self) -> torch.Tensor:
        return self.moe_block.router


class MoEForCausalLM(LlamaForCausalLM):
    def make_layer(self, config: ModelConfig, weights: dict, index: int, policy: LayerPolicy) -> DecoderLayer:
        assert config.moe is not None
        cls = MoEDecoderLayer if config.moe.is_sparse(index) else DecoderLayer
        return cls(config, weights, f"model.layers.{index}.", policy)
