"""`tokenmill bench mixes`: the GGUF mixes a CPU user downloads, made from the bundled model.

Why: issue 22's targets (memory, quality, speed against llama-bench) are judged per mix (Q4_K_M,
Q5_K_M, Q6_K, Q3_K_M, Q8_0, IQ4_XS), and those files are benchmark inputs, not fixtures: they are
made here by llama.cpp's own `llama-quantize --allow-requantize` from the bundled Q4_1 file, into a
cache folder, so that the next person measures the same files with one command. The suite never
needs llama.cpp; this command does (../shared/tools/build-llama-cpp.sh builds llama-quantize).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import Any

from tokenmill.bench.llama_cpp_peer import PeerError, find_binary

# The mixes, in its table's order.
MIXES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q3_K_M", "Q8_0", "IQ4_XS")
# Made on request only: ggml's 1- and 2-bit types (Q1_0 needs rows of 128 weights: Gemma 3's, not
# the bundled model's 576), and other llama-quantize types a user may meet.
OTHER_TYPES = ("Q1_0", "Q2_0", "Q2_K", "Q3_K_S", "Q3_K_L", "Q4_K_S", "Q5_K_S", "Q4_0", "Q5_0", "Q5_1",
               "IQ4_NL", "IQ3_S", "IQ3_M", "TQ1_0", "TQ2_0", "MXFP4_MOE", "BF16", "F16")
DEFAULT_OUT = "~/.cache/tokenmill-bench/mixes"


def add_mixes_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "mixes", help="make the issue-22 GGUF mixes (Q4_K_M, ...) from the bundled model with llama-quantize"
    )
    p.add_argument("--mix", nargs="*", choices=MIXES + OTHER_TYPES, default=list(MIXES),
                   help="which mixes (default: the issue's six; any of the choices llama-quantize takes)")
    p.add_argument("--source", default=None, help="GGUF to re-quantize (default: the bundled model)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"folder of the files (default: {DEFAULT_OUT})")
    p.add_argument("--llama-cpp", metavar="DIR", default=None,
                   help="folder of llama-quantize (or a llama.cpp checkout with build/bin)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--force", action="store_true", help="remake files that already exist")
    p.set_defaults(func=cmd_mixes)


def mix_path(out: str, mix: str, source: str) -> str:
    """Where `mix` of `source` goes: <out>/<source's name without its type>-<mix>.gguf."""
    stem = os.path.basename(source).removesuffix(".gguf")
    stem = stem.rsplit(".", 1)[0] if "." in stem else stem  # "SmolLM2-135M-Instruct.Q4_1" -> "...Instruct"
    return os.path.join(os.path.expanduser(out), f"{stem}-{mix}.gguf")


def make_mix(binary: str, source: str, target: str, mix: str, threads: int) -> None:
    """Runs llama-quantize for one mix, writing to a temporary name first: an interrupted run never
    leaves a truncated file that a later run would take as made."""
    partial = target + ".partial"
    cmd = [binary, "--allow-requantize", source, partial, mix, str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0 or not os.path.isfile(partial):
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise PeerError(f"llama-quantize failed for {mix} (exit {proc.returncode}): " + " | ".join(tail))
    os.replace(partial, target)


def cmd_mixes(args: argparse.Namespace) -> int:
    from tokenmill.model.default_model import default_model_path

    source = os.path.abspath(os.path.expanduser(args.source)) if args.source else default_model_path()
    if not os.path.isfile(source):
        raise PeerError(f"--source {source} is not a file")
    binary = find_binary("llama-quantize", args.llama_cpp)
    os.makedirs(os.path.expanduser(args.out), exist_ok=True)
    for mix in args.mix:
        target = mix_path(args.out, mix, source)
        if os.path.isfile(target) and not args.force:
            print(f"{mix}: {target} (exists, {os.path.getsize(target) / 1e6:.1f} MB)")
            continue
        make_mix(binary, source, target, mix, args.threads)
        print(f"{mix}: {target} ({os.path.getsize(target) / 1e6:.1f} MB)")
        sys.stdout.flush()
    return 0
