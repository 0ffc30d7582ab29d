"""`tokenmill bench make-low-bit`: a random-weight llama GGUF of a realistic shape in Q1_0, Q2_0 or Q4_K.

1-bit models ship as GGUFs whose matrices are ggml's Q1_0 (one fp16 d per 128 weights, a bit each),
and no such file is on the registries this project may use; nor is a Q4_K_M of a model of that size,
the file llama.cpp users run most. The way `make-moe` makes its file (an fp32 model from transformers,
converted, then quantized) would need 32 GB for an 8B shape, so this writes the blocks directly:
random codes (Q4_K: and sub-block scales) with the blocks' fp16 numbers set, the embedding and the
output in Q8_0 as llama-quantize keeps them for the low-bit types, and the bundled SmolLM2's tokenizer
(49,152 tokens) and chat template, so that llama.cpp loads the same file and the chat endpoints serve
it. Random weights make the numbers fair for speed, never for quality. The default shape is Llama 3
8B's without its vocabulary (hidden 4096, 32 layers, 14,336 wide MLP, 32 heads / 8 KV heads): ~6.98B
parameters in the layers, ~1.2 GB as Q1_0, ~4.4 GB as Q4_K (every layer matrix Q4_K: a Q4_K_M's
main type, without its Q6_K share).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from tokenmill.model.quant_formats import format_of

# The fp16 numbers that open each of the layers' blocks (d; Q4_K: d, then dmin), so that the weights'
# spread stays ~0.01-0.02 around 0, an initialised model's (Q4_K: d x a 6-bit scale x a 4-bit code
# less dmin x a 6-bit min).
_LAYER_D = {"Q1_0": (0.02,), "Q2_0": (0.015,), "Q4_K": (4e-5, 3e-4)}
_OUTPUT_TYPE = "Q8_0"


def add_make_low_bit_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("make-low-bit", help="write a random-weight Q1_0 / Q2_0 / Q4_K llama GGUF of a realistic shape",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the GGUF file to write")
    p.add_argument("--type", choices=sorted(_LAYER_D), default="Q1_0")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--ff", type=int, default=14336)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run_make_low_bit)


def random_blocks(kind: str, n: int, k: int, d: tuple[float, ...], rng: np.random.Generator) -> np.ndarray:
    """uint8 [n, row bytes]: random codes (and sub-block scales), every block's leading fp16 numbers
    (d; Q4_K: d and dmin) set to `d`: random bytes there could be inf or NaN."""
    fmt = format_of(kind)
    if k % fmt.block_elems:
        raise ValueError(f"rows of {k} weights are not whole {kind} blocks of {fmt.block_elems}")
    blocks = rng.integers(0, 256, size=(n * k // fmt.block_elems, fmt.block_bytes), dtype=np.uint8)
    blocks[:, 0 : 2 * len(d)] = np.tile(np.array(d, np.float16).view(np.uint8), (len(blocks), 1))
    return blocks.reshape(n, -1)


def shape_problem(args: argparse.Namespace) -> str | None:
    """Why the shape cannot be written (None if it can): every matrix's rows must be whole blocks."""
    block = format_of(args.type).block_elems
    if args.hidden % args.heads or args.heads % args.kv_heads:
        return f"--hidden {args.hidden} / --heads {args.heads} / --kv-heads {args.kv_heads} do not divide"
    for name, k in (("--hidden", args.hidden), ("--ff", args.ff)):
        if k % block or k % format_of(_OUTPUT_TYPE).block_elems:
            return f"{name} {k} is not a whole number of {args.type} blocks of {block} weights"
    return None


def run_make_low_bit(args: argparse.Namespace) -> int:
    import gguf

    from tokenmill.model.default_model import default_model_path
    from tokenmill.model.gguf_metadata import read_gguf_metadata

    problem = shape_problem(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    meta = read_gguf_metadata(default_model_path())
    vocab = len(meta["tokenizer.ggml.tokens"])
    h, ff, head_dim = args.hidden, args.ff, args.hidden // args.heads
    rng = np.random.default_rng(args.seed)
    writer = gguf.GGUFWriter(os.fspath(args.out), "llama")
    writer.add_block_count(args.layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(h)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(args.heads)
    writer.add_head_count_kv(args.kv_heads)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(meta.get("tokenizer.ggml.pre", "default"))
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_types([int(t) for t in meta["tokenizer.ggml.token_type"]])
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    writer.add_bos_token_id(int(meta["tokenizer.ggml.bos_token_id"]))
    writer.add_eos_token_id(int(meta["tokenizer.ggml.eos_token_id"]))
    if meta.get("tokenizer.chat_template"):  # so that the chat endpoints serve it too
        writer.add_chat_template(meta["tokenizer.chat_template"])

    def matrix(name: str, kind: str, n: int, k: int, d: float) -> None:
        # int8 bytes with the logical shape: gguf-py cannot size a type it does not know (Q2_0)
        data = random_blocks(kind, n, k, d, rng)
        writer.add_tensor(name, data.view(np.int8), raw_shape=(n, k), raw_dtype=format_of(kind).type_id)

    matrix("token_embd.weight", _OUTPUT_TYPE, vocab, h, (0.0005,))
    matrix("output.weight", _OUTPUT_TYPE, vocab, h, (0.0005,))
    writer.add_tensor("output_norm.weight", np.ones(h, np.float32))
    kv = head_dim * args.kv_heads
    d = _LAYER_D[args.type]
    for i in range(args.layers):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", np.ones(h, np.float32))
        writer.add_tensor(p + "ffn_norm.weight", np.ones(h, np.float32))
        for name, (n, k) in {"attn_q": (h, h), "attn_k": (kv, h), "attn_v": (kv, h), "attn_output": (h, h),
                             "ffn_gate": (ff, h), "ffn_up": (ff, h), "ffn_down": (h, ff)}.items():
            matrix(p + name + ".weight", args.type, n, k, tuple(x * (0.6 if name == "ffn_down" else 1.0) for x in d))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"{args.out}: {os.path.getsize(args.out) / 1e9:.2f} GB ({args.type}, {args.layers} layers of {h})")
    return 0
