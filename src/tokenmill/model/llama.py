"""The llama family of decoders: llama (incl. llama3 RoPE scaling, tied embeddings), mistral,
qwen2 (q/k/v bias) and qwen3 (RMSNorm on each q/k head). They differ only in flags of ModelConfig.

The model works on one flat batch of tokens from many requests: `forward(input_ids, positions, meta)`
with no batch dimension; which request a token belongs to only matters to attention, via `meta`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.model import prompt_attention
from tokenmill.model.attention import AttentionBackend, AttentionMetadata, TorchPagedAttention
from tokenmill.model.config import ModelConfig
from tokenmill.model.fused_decode import FusedDecodeStack
from tokenmill.model.kernels import fused_ops
from tokenmill.model.layers.factory import LayerPolicy, make_embedding, make_linear
from tokenmill.model.layers.quantized_linear import QuantizedLinear, gated_silu
from tokenmill.model.rope import RotaryEmbedding


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same operation order as transformers' LlamaRMSNorm, so fp32 results agree to the last bits.
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # One kernel instead of five passes over x; rounding differs from transformers' in the last
    # bits, so only fast mode uses it.
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def weight_bytes(parts: list) -> int:
    """Bytes of the tensors in `parts` (tensors or layers holding them), each storage counted once."""
    seen: dict[int, int] = {}

    def add(obj) -> None:
        if obj is None:
            return
        if isinstance(obj, torch.Tensor):
            seen[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
            return
        for name in ("weight", "weight_bf16", "bias", "codes", "scales", "mins", "parts", "inner"):
            value = getattr(obj, name, None)
            for item in value if isinstance(value, list) else [value]:
                add(item)

    for part in parts:
        add(part)
    return sum(seen.values())


class DecoderLayer:
    def __init__(self, config: ModelConfig, weights: dict, prefix: str, policy: LayerPolicy):
        def w(name: str):
            return weights[prefix + name]

        c = config
        self.eps = c.rms_norm_eps
        self.norm = rms_norm if policy.precision == "exact" else fused_rms_norm
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        # q, k and v (and gate and up) share their input: one fused GEMM each instead of three/two.
        qkv = [w("self_attn.q_proj.weight"), w("self_attn.k_proj.weight"), w("self_attn.v_proj.weight")]
        qkv_bias = None
        if c.attention_bias:
            qkv_bias = torch.cat([w("self_attn.q_proj.bias"), w("self_attn.k_proj.bias"), w("self_attn.v_proj.bias")])
        self.qkv = make_linear(qkv, qkv_bias, policy)
        self.o_proj = make_linear([w("self_attn.o_proj.weight")], None, policy)
        self._init_mlp(c, weights, prefix, policy)
        self.input_norm = w("input_layernorm.weight")
        self.post_norm = w("post_attention_layernorm.weight")
        self.q_norm = w("self_attn.q_norm.weight") if c.qk_norm else None
        self.k_norm = w("self_attn.k_norm.weight") if c.qk_norm else None
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim

    def _init_mlp(self, config: ModelConfig, weights: dict, prefix: str, policy: LayerPolicy) -> None:
        """The feed-forward block: a gated SiLU MLP here; a mixture of experts in model/moe.py."""
        # gate and up share their input: one fused GEMM instead of two.
        self.gate_up = make_linear([weights[prefix + "mlp.gate_proj.weight"], weights[prefix + "mlp.up_proj.weight"]],
                                   None, policy)
        self.down = make_linear([weights[prefix + "mlp.down_proj.weight"]], None, policy)

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)

    def mlp_fused(self, h: torch.Tensor) -> torch.Tensor:
        return self.down(gated_silu(self.gate_up, h))

    def mlp_parts(self) -> dict[str, object]:
        """The feed-forward block's linears by name (weights counted, layers described)."""
        return {"gate_up": self.gate_up, "down": self.down}

    def linears(self) -> list:
        return [self.qkv, self.o_proj, *self.mlp_parts().values()]

    def forward(self, x, cos, sin, attention, k_cache, v_cache, meta):
        t = x.shape[0]
        norm = self.norm
        h = norm(x, self.input_norm, self.eps)
        qkv = self.qkv(h)
        v = qkv[:, self.q_size + self.kv_size :].reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is None:
            # q and k heads side by side: RoPE in one pass over both (same arithmetic per element).
            qk = qkv[:, : self.q_size + self.kv_size].reshape(t, self.num_heads + self.num_kv_heads, self.head_dim)
            q, k = RotaryEmbedding.apply(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)
        else:
            q = norm(qkv[:, : self.q_size].reshape(t, self.num_heads, self.head_dim), self.q_norm, self.eps)
            k = norm(qkv[:, self.q_size : self.q_size + self.kv_size].reshape(t, self.num_kv_heads, self.head_dim),
                     self.k_norm, self.eps)
            q, k = RotaryEmbedding.apply(q, cos, sin), RotaryEmbedding.apply(k, cos, sin)
        attn = attention.forward(q.contiguous(), k, v, k_cache, v_cache, meta)
        x = x + self.o_proj(attn)
        return x + self.mlp(norm(x, self.post_norm, self.eps))

    def bf16_start(self) -> int | None:
        """From how many rows every linear of this layer takes bf16 activations as they are (None: some
        never does): the dequantize + bf16 GEMM path, or the AMX tiles of Q8_0 / Q6_K, which round
        their float32 input to the same bf16 (QuantizedLinear.bf16_input_from_rows)."""
        starts = {part.bf16_input_from_rows if isinstance(part, QuantizedLinear) else None for part in self.linears()}
        return starts.pop() if len(starts) == 1 else None

    def forward_fused(self, x, h, cos, sin, attention, k_cache, v_cache, meta, bf16: bool = False) -> torch.Tensor:
        """Fast path with the fused C++ steps: `h` is this layer's normed input; adds the attention
        output to `x` in place and returns the MLP output, which the caller adds to `x` together with
        the next norm (one pass instead of two). With `bf16` (large steps, whose linears run bf16
        GEMMs, or AMX tiles that round their input to bf16) the linears' inputs stay bf16, and the
        GEMMs' outputs: the same numbers without conversions."""
        qkv = self.qkv(h)
        q_bf16 = attention.bf16_queries(meta, k_cache)
        q = fused_ops.rope_store(qkv, cos, sin, self.num_heads, self.num_kv_heads, k_cache, v_cache,
                                 meta.slot_mapping, q_bf16)
        # in o_proj's input dtype: bf16 where it runs a bf16 GEMM (`bf16`), rounded once as it would
        # round it, else float32 (the kernel's input)
        attn = attention.attend(q, k_cache, v_cache, meta, torch.bfloat16 if bf16 else torch.float32)
        # o_proj's output as float32, as a float32 input gives it: add_rms_norm_ sums a bf16 delta's
        # squares in another order (last bits, which moved top-1 agreement by ~0.4 % of positions)
        h = fused_ops.add_rms_norm_(x, self.o_proj(attn).float(), self.post_norm, self.eps, bf16)
        return self.mlp_fused(h)


class LlamaForCausalLM:
    def __init__(
        self,
        config: ModelConfig,
        weights: dict,
        max_positions: int,
        policy: LayerPolicy | None = None,
        attention: AttentionBackend | None = None,
    ) -> None:
        self.config = config
        policy = policy or LayerPolicy()
        # Prepared once: with tied embeddings the lm_head shares it (one copy in memory).
        embed = policy.prepare(weights["model.embed_tokens.weight"])
        self.layers = [self.make_layer(config, weights, i, policy) for i in range(config.num_layers)]
        self.norm = weights["model.norm.weight"]
        lm_head = embed if config.tie_word_embeddings else weights["lm_head.weight"]
        self.lm_head = make_linear([lm_head], None, policy, lm_head=True)
        if config.tie_word_embeddings and isinstance(self.lm_head, QuantizedLinear):
            embed = self.lm_head.weight  # the lm_head's layout (maybe re-blocked): still one copy
        self.embed_tokens = make_embedding(embed, policy)
        self.rope = RotaryEmbedding(config, max_positions)
        # Fast mode on CPUs with AMX attends long prompt chunks in bf16 on the tiles, the faster there
        # (model/prompt_attention.py); the paged kernel takes the rest as runs of decode rows.
        bf16_prompts = policy.precision == "fast" and prompt_attention.faster_here()
        self.attention = attention or TorchPagedAttention(config.num_heads, config.num_kv_heads, config.head_dim,
                                                          bf16_prompts=bf16_prompts)
        # Fast mode runs the elementwise steps fused in C++ where it can (not for q/k norms, qwen3).
        self.fused = policy.precision == "fast" and not config.qk_norm and fused_ops.available()
        self.fused = self.fused and isinstance(self.attention, TorchPagedAttention)  # fp32 caches it writes
        # Decode steps of the fast path as one C++ call over all layers (model/fused_decode.py).
        self.fused_decode = self.fused and FusedDecodeStack.supports(self)
        # Steps of at least this many rows keep the linears' activations in bf16 (None: never), in
        # the layers whose linears all take them as they are there (bf16 GEMMs; Q8_0 / Q6_K tiles): a
        # mix (a Q5_K ffn_down in 3 of 30 IQ4_XS layers) keeps the others' activations bf16 instead
        # of converting around every linear. Why for the tiles: a Q8_0 512-token prompt spent ~3 % in
        # rounding each linear's float32 input to bf16 (docs/benchmarks.md, session 35).
        starts = [layer.bf16_start() for layer in self.layers]
        common = {start for start in starts if start is not None}
        self.bf16_rows = max(common) if self.fused and common else None
        self.bf16_layers = [start is not None for start in starts]
        self._decode_stack: FusedDecodeStack | None = None

    def make_layer(self, config: ModelConfig, weights: dict, index: int, policy: LayerPolicy) -> DecoderLayer:
        return DecoderLayer(config, weights, f"model.layers.{index}.", policy)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rope.lookup(positions)
        if self.fused_decode and FusedDecodeStack.handles(x.shape[0], meta):
            return self._stack_for(kv_caches).run(x, cos, sin, meta)
        if self.fused:
            eps = self.config.rms_norm_eps
            bf16 = self.bf16_rows is not None and x.shape[0] >= self.bf16_rows
            in_bf16 = [bf16 and layer_bf16 for layer_bf16 in self.bf16_layers] + [False]  # the last: hidden
            h = fused_rms_norm(x, self.layers[0].input_norm, eps)
            h = h.to(torch.bfloat16) if in_bf16[0] else h
            norms = [layer.input_norm for layer in self.layers[1:]] + [self.norm]
            for i, (layer, (k_cache, v_cache), next_norm) in enumerate(zip(self.layers, kv_caches, norms)):
                delta = layer.forward_fused(x, h, cos, sin, self.attention, k_cache, v_cache, meta, in_bf16[i])
                h = fused_ops.add_rms_norm_(x, delta, next_norm, eps, in_bf16[i + 1])
            return h
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x = layer.forward(x, cos, sin, self.attention, k_cache, v_cache, meta)
        return self.layers[0].norm(x, self.norm, self.config.rms_norm_eps)

    def _stack_for(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> FusedDecodeStack:
        if self._decode_stack is None or self._decode_stack.kv_caches is not kv_caches:
            self._decode_stack = FusedDecodeStack(self, kv_caches)
        return self._decode_stack

    def weight_bytes(self) -> int:
        """Bytes of weights the model holds (shared tensors, e.g. tied embeddings, counted once)."""
        parts = [self.embed_tokens, self.lm_head, self.norm]
        for layer in self.layers:
            parts += [*layer.linears(), layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm]
        return weight_bytes(parts)

    def describe(self) -> list[str]:
        """What each kind of layer runs as (logged at start-up)."""
        first = self.layers[0]
        parts = {"qkv": first.qkv, "o_proj": first.o_proj, **first.mlp_parts(), "lm_head": self.lm_head}
        lines = [f"{name}: {layer.describe()}" for name, layer in parts.items()]
        if self.fused_decode:
            lines.append(f"steps of all decode rows (up to {FusedDecodeStack.max_rows()}): one fused C++ call "
                         "over the layer stack")
        if self.bf16_rows is not None:
            some = "" if all(self.bf16_layers) else f" in {sum(self.bf16_layers)} of {len(self.layers)} layers"
            lines.append(f"steps of {self.bf16_rows}+ rows: bf16 activations between the linears and the fused ops{some}")
        return lines

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits for the rows that sample; the sampler always sees fp32."""
        return self.lm_head(hidden).float()
