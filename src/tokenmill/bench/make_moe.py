"""`tokenmill bench make-moe`: a random-weight mixture-of-experts GGUF of a realistic shape, for speed.

No real MoE file ships on the registries this project may use, so the speed targets of issue 24 are
measured on one made here, the way a user's file is made: transformers builds a Mixtral (default)
or Qwen3-MoE of the given shape with random weights (`save_pretrained`), llama.cpp's own `convert_hf_to_gguf.py` turns it
into a BF16 GGUF and `llama-quantize` into Q4_K_M (or another type). Both tokenmill and llama.cpp then
run the same file. The vocabulary is the bundled SmolLM2's (49,152 tokens, saved into the folder), so
llama.cpp's converter and tokenizer accept it. Random weights make the numbers fair for speed, never
for quality: routing spreads tokens over the experts about evenly, as a trained router roughly does.

Mixtral is the default because its attention is llama's, which the fused decode step covers; Qwen3's
q/k norms keep a qwen3_moe model on the op-by-op path for now (model/fused_decode.py).

The default shape (hidden 1024, 16 layers, 32 experts of width 512, top-4) holds ~0.9B parameters,
~0.19B of them active per token: ~0.55 GB as Q4_K_M. Intermediates go under --out and are deleted
unless --keep-intermediates.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

from tokenmill.bench.llama_cpp_peer import PeerError, find_binary
from tokenmill.model.default_model import DEFAULT_MODEL_FILE, DEFAULT_MODEL_PACKAGE


def add_make_moe_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("make-moe", help="write a random-weight MoE GGUF of a realistic shape",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for the files; the GGUF is OUT/moe-<type>.gguf")
    p.add_argument("--family", choices=("mixtral", "qwen3_moe"), default="mixtral")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--expert-width", type=int, default=512)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--type", default="Q4_K_M", help="llama-quantize's type name (default Q4_K_M)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--llama-cpp", default=None, help="llama.cpp checkout or binaries folder (default: the peers build)")
    p.add_argument("--keep-intermediates", action="store_true", help="keep the HF folder and the BF16 GGUF")
    p.set_defaults(func=run_make_moe)


def _log(message: str) -> None:
    print(f"[make-moe {time.strftime('%H:%M:%S')}] {message}", flush=True)


def write_hf_model(folder: str, args: argparse.Namespace) -> None:
    """A random MoE of the requested family and shape, bf16, with the bundled tokenizer beside it."""
    import importlib.util

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise PeerError(f"{DEFAULT_MODEL_PACKAGE} is not installed: its tokenizer is the model's vocabulary")
    tokenizer = AutoTokenizer.from_pretrained(list(spec.submodule_search_locations)[0], gguf_file=DEFAULT_MODEL_FILE)
    if args.family == "mixtral":  # experts intermediate_size wide, always renormalised
        family = {"intermediate_size": args.expert_width, "num_local_experts": args.experts, "sliding_window": None}
    else:
        family = {"intermediate_size": args.expert_width * args.top_k, "moe_intermediate_size": args.expert_width,
                  "num_experts": args.experts, "norm_topk_prob": True}
    config = AutoConfig.for_model(
        args.family, vocab_size=len(tokenizer), hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_experts_per_tok=args.top_k, **family,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
        max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)


def _run(cmd: list[str]) -> None:
    _log(" ".join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-10:])
        raise PeerError(f"{cmd[0] if cmd[0] != sys.executable else cmd[1]} exited with {proc.returncode}:\n{tail}")


def converter_script(llama_cpp: str | None) -> str:
    """convert_hf_to_gguf.py of the llama.cpp tree whose llama-quantize is used."""
    quantize = find_binary("llama-quantize", llama_cpp)
    folder = os.path.dirname(quantize)
    for root in (folder, os.path.dirname(folder), os.path.dirname(os.path.dirname(folder))):
        script = os.path.join(root, "convert_hf_to_gguf.py")
        if os.path.isfile(script):
            return script
    raise PeerError(f"no convert_hf_to_gguf.py in the llama.cpp tree above {folder}")


def run_make_moe(args: argparse.Namespace) -> int:
    out = os.path.abspath(os.path.expanduser(args.out))
    os.makedirs(out, exist_ok=True)
    if args.hidden % args.heads or args.experts < args.top_k:
        raise SystemExit("--hidden must be a multiple of --heads and --experts at least --top-k")
    quantize, script = find_binary("llama-quantize", args.llama_cpp), converter_script(args.llama_cpp)
    folder, bf16 = os.path.join(out, "hf"), os.path.join(out, "moe-bf16.gguf")
    final = os.path.join(out, f"moe-{args.type}.gguf")
    _log(f"random {args.family}: hidden {args.hidden}, {args.layers} layers, {args.experts} experts of width "
         f"{args.expert_width}, top-{args.top_k} -> {folder}")
    write_hf_model(folder, args)
    _run([sys.executable, script, folder, "--outtype", "bf16", "--outfile", bf16])
    _run([quantize, bf16, final, args.type])
    if not args.keep_intermediates:
        shutil.rmtree(folder)
        os.remove(bf16)
    _log(f"wrote {final} ({os.path.getsize(final) / 1e6:.0f} MB)")
    print(final)
    return 0
