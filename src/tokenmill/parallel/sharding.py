"""Which slice of each weight a tensor-parallel rank holds (Megatron's layout, as vLLM and SGLang use).

- Column-parallel (output rows split): q/k/v by heads, gate/up by the intermediate size (each MoE
  expert, and a shared expert, like a dense MLP; routers whole on every rank). Each rank
  computes its own heads' attention end to end, over its own KV heads' pages.
- Row-parallel (input columns split): o_proj and down; each rank's product is a partial sum, added
  up by one all-reduce per layer each (parallel/layers.py).
- Vocabulary-parallel: the embedding and the lm_head by vocabulary rows; a lookup is a masked
  lookup plus an all-reduce, logits an all-gather.

Quantized weights are sliced in their packed form before any re-layout for a kernel: a GGUF matrix
as the file's rows of blocks (rows are whole, so a column-parallel shard is lossless), a row-parallel
shard between blocks (32 weights, 256 for K-quants and IQ4_XS), so each rank holds exactly the file's
numbers for its slice. When a shard boundary would cut a block (e.g. a K-quant down_proj whose
intermediate size over the ranks is not a multiple of 256), that block's scale belongs to both sides:
the shard is dequantized to the file's exact fp32 values instead (fast mode then runs it dense, as a
bf16 GEMM). Rank 0 says so in one line for all such tensors (a MoE cuts every expert's down): their
types, how many, what this rank's shards cost, and the sizes the model accepts that keep every block
whole.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from dataclasses import dataclass

import torch

from tokenmill.errors import InvalidRequest
from tokenmill.model.config import ModelConfig
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.quant import GROUP, QuantizedWeight
from tokenmill.model.quant_formats import GGUFWeight
from tokenmill.parallel.layers import AllReduceLinear, VocabParallelEmbedding, VocabParallelLMHead
from tokenmill.parallel.process_group import TensorParallelGroup

logger = logging.getLogger(__name__)

Weight = torch.Tensor | QuantizedWeight | GGUFWeight


def _split_dims(config: ModelConfig) -> dict[str, int]:
    """The sizes a tensor-parallel size must divide, by name."""
    dims = {"attention heads": config.num_heads, "KV heads": config.num_kv_heads,
            "intermediate size": config.intermediate_size}
    if config.moe is not None:  # each expert is split like a dense MLP
        dims["expert intermediate size"] = config.moe.expert_intermediate_size
        if config.moe.shared_expert_intermediate_size:
            dims["shared expert intermediate size"] = config.moe.shared_expert_intermediate_size
    return dims


def accepted_sizes(config: ModelConfig) -> list[int]:
    """Every tensor-parallel size the model's heads, KV heads and intermediate sizes divide by."""
    dims = _split_dims(config).values()
    return [n for n in range(1, config.num_heads + 1) if all(v % n == 0 for v in dims)]


def check_tensor_parallel_size(config: ModelConfig, size: int) -> None:
    """Refuses a size that does not divide the heads, KV heads and intermediate size, naming the
    sizes that would work."""
    bad = [f"{name} ({value})" for name, value in _split_dims(config).items() if value % size]
    if not bad:
        return
    raise InvalidRequest(
        f"tensor_parallel_size {size} does not divide the model's {', '.join(bad)}; sizes that work for "
        f"this model: {', '.join(map(str, accepted_sizes(config)))}", param="tensor_parallel_size",
    )


@dataclass(frozen=True)
class Cut:
    """A packed weight whose shard boundary falls inside a block: the shard runs dequantized."""

    name: str
    kind: str  # the GGUF type, or "int8" / "int4" (a Hugging Face model quantized at load)
    block: int  # weights a block
    inputs: int  # the whole weight's input columns
    file_bytes: int  # this shard's bytes packed
    resident_bytes: int  # its bytes dequantized


def _keeps_blocks_whole(cut: Cut, size: int) -> bool:
    return cut.inputs % size == 0 and (cut.inputs // size) % cut.block == 0


def describe_cuts(cuts: list[Cut], config: ModelConfig, size: int) -> str | None:
    """One line for the log on every weight `size` ranks cut inside a block, or None."""
    if not cuts:
        return None
    kinds = Counter((c.kind, c.block) for c in cuts)
    what = ", ".join(f"{n} {kind} (blocks of {block})" for (kind, block), n in sorted(kinds.items()))
    works = [n for n in accepted_sizes(config) if all(_keeps_blocks_whole(c, n) for c in cuts)]
    file_mb = sum(c.file_bytes for c in cuts) / 1e6
    resident_mb = sum(c.resident_bytes for c in cuts) / 1e6
    return (f"tensor-parallel size {size} cuts blocks of {len(cuts)} quantized matrices ({what}; the first "
            f"{cuts[0].name}), so their shards run dequantized: this rank's {file_mb:.1f} MB of them take "
            f"{resident_mb:.1f} MB; sizes this model accepts that keep every block whole: "
            f"{', '.join(map(str, works))}")


def vocab_range(vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """The vocabulary rows rank `rank` holds: equal shares (the last one shorter when it doesn't divide)."""
    share = -(-vocab_size // world_size)
    return min(rank * share, vocab_size), min((rank + 1) * share, vocab_size)


def _rows(w: Weight, start: int, end: int) -> Weight:
    if isinstance(w, (QuantizedWeight, GGUFWeight)):
        return w.row_slice(start, end)
    return w[start:end].contiguous()


def _columns(w: Weight, start: int, end: int, name: str, cuts: list[Cut]) -> Weight:
    if not isinstance(w, (QuantizedWeight, GGUFWeight)):
        return w[:, start:end].contiguous()
    block = w.format.block_elems if isinstance(w, GGUFWeight) else GROUP
    if start % block == 0 and end % block == 0:
        return w.column_slice(start, end)
    # A shard boundary inside a block: its scale belongs to both sides, so this shard can't stay
    # packed. Dense fp32 keeps the file's values exact.
    k = w.shape[1]
    dense = w.dequantize(torch.float32)[:, start:end].contiguous()
    cuts.append(Cut(name, w.kind, block, k, w.nbytes * (end - start) // k, dense.numel() * dense.element_size()))
    return dense


def _whole(x: torch.Tensor) -> torch.Tensor:
    return x


class TensorParallelShard:
    """Rank `group.rank`'s part of the model (the ModelShard that model/builder.py takes)."""

    def __init__(self, group: TensorParallelGroup) -> None:
        self.group = group
        self.rank, self.size = group.rank, group.world_size
        self.cuts: list[Cut] = []  # the last shard_weights' weights cut inside a block

    def shard_config(self, config: ModelConfig) -> ModelConfig:
        check_tensor_parallel_size(config, self.size)
        moe = config.moe
        if moe is not None:
            moe = dataclasses.replace(
                moe, expert_intermediate_size=moe.expert_intermediate_size // self.size,
                shared_expert_intermediate_size=moe.shared_expert_intermediate_size // self.size)
        return dataclasses.replace(config, num_heads=config.num_heads // self.size,
                                   num_kv_heads=config.num_kv_heads // self.size,
                                   intermediate_size=config.intermediate_size // self.size, moe=moe)

    def shard_weights(self, config: ModelConfig, weights: dict) -> dict:
        check_tensor_parallel_size(config, self.size)
        r, n, d = self.rank, self.size, config.head_dim
        q = config.num_heads * d // n
        kv = config.num_kv_heads * d // n
        v0, v1 = vocab_range(config.vocab_size, r, n)
        self.cuts = []
        out: dict = {}
        for name, w in weights.items():
            if name.endswith(("q_proj.weight", "q_proj.bias")):
                out[name] = _rows(w, r * q, (r + 1) * q)
            elif name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
                out[name] = _rows(w, r * kv, (r + 1) * kv)
            elif name.endswith(("gate_proj.weight", "up_proj.weight", ".w1.weight", ".w3.weight")):
                # the MLP's, an expert's or the shared expert's intermediate rows (Mixtral: w1, w3)
                inter = w.shape[0] // n
                out[name] = _rows(w, r * inter, (r + 1) * inter)
            elif name.endswith("o_proj.weight"):
                out[name] = _columns(w, r * q, (r + 1) * q, name, self.cuts)
            elif name.endswith(("down_proj.weight", ".w2.weight")):
                inter = w.shape[1] // n
                out[name] = _columns(w, r * inter, (r + 1) * inter, name, self.cuts)
            elif name in ("model.embed_tokens.weight", "lm_head.weight"):
                out[name] = _rows(w, v0, v1)
            else:  # norms, MoE routers and the shared expert's gate: every rank needs all of them
                out[name] = w
        if r == 0 and (line := describe_cuts(self.cuts, config, n)) is not None:  # every rank cuts alike
            logger.warning("%s", line)
        return out

    def parallelize(self, model: LlamaForCausalLM) -> None:
        for layer in model.layers:
            layer.o_proj = AllReduceLinear(layer.o_proj, self.group)
            if hasattr(layer, "moe_block"):
                # Every expert's down (and the shared expert's) gives a partial sum: one all-reduce
                # of the block's output adds them all up.
                layer.combine = AllReduceLinear(_whole, self.group)
            else:
                layer.down = AllReduceLinear(layer.down, self.group)
        v0, v1 = vocab_range(model.config.vocab_size, self.rank, self.size)
        model.embed_tokens = VocabParallelEmbedding(model.embed_tokens, v0, v1, self.group)
        share = -(-model.config.vocab_size // self.size)
        model.lm_head = VocabParallelLMHead(model.lm_head, share, model.config.vocab_size, self.group)
        # The one-call decode step and bf16 activations between GEMMs assume whole layers on one rank.
        model.fused_decode = False
        model.bf16_rows = None
