"""A CPU without AVX-512 (most of the CPUs people run models on), as this machine runs when
TOKENMILL_CPU_ISA=avx2 caps its kernels: GGUF mixes load into the AVX2 blocked kernel (not bf16
copies), prompts take fp32 GEMMs (not the bf16 ones such a CPU emulates), and fast mode agrees with
exact as it does on VNNI, at prompt and decode row counts, with decode steps in the fused step's AVX2
kit. The cap's variable is checked by name. The kernel's arithmetic per format is
tests/model/test_block_decoders.py's (its kernel tests run on both kernels); the fused step's on the
AVX2 kit against the layers op by op, tests/model/test_fused_decode*.py's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.model.test_gguf_mixes import MIXES, VOCAB, all_logits, engine, type_of
from tests.tiny_models import make_tiny_model, write_tiny_gguf
from tokenmill.model.kernels import cpu_isa, decode_step, quant_kernel

ROOT = Path(__file__).resolve().parents[2]
CHECKED = ("Q4_K_M", "IQ4_XS", "Q1_0")  # K-quants with Q5_0 / Q8_0; the codebooks; 1-2 bit + MXFP4
IDS = [int(i) for i in torch.randint(3, VOCAB, (136,), generator=torch.Generator().manual_seed(1))]

# Runs in a process capped at AVX2: what each mix's layers became, and the fast logits of a prompt
# step of 136 rows (an fp32 GEMM from AVX2_DENSE_MIN_ROWS) and of 8 rows (the kernel).
SCRIPT = """
import json, sys, torch
from tokenmill.model.fused_decode import FusedDecodeStack
from tokenmill.model.kernels import cpu_isa, decode_step, quant_kernel
from tokenmill.model.layers.quantized_linear import AVX2_DENSE_MIN_ROWS
from tests.model.test_gguf_mixes import all_logits, engine
ids, out = json.loads(sys.argv[1]), {}
assert len(ids) >= AVX2_DENSE_MIN_ROWS > 8
out["kernel"], out["bf16_native"] = quant_kernel.blocked_kernel(), cpu_isa.bf16_gemm_native()
out["kit"] = decode_step.kit()
for path in sys.argv[3:]:
    core = engine(path, "fast")
    layer = core.runner.model.layers[0]
    short = engine(path, "fast")
    logits = {"prompt": all_logits(core, ids), "short": all_logits(short, ids[:8])}
    stack = short.runner.model._decode_stack  # the 8-row prompt ran as decode rows, in the fused step
    out[path] = {"o_proj": layer.o_proj.describe(), "down": layer.down.describe(),
                 "fused": bool(core.runner.model.fused_decode), "stack_kit": None if stack is None else stack.kit}
    torch.save(logits, path + ".fast.pt")
decode_step.kit = lambda: decode_step.KITS["vnni"]  # what an AVX2 CPU cannot run
try:
    FusedDecodeStack(short.runner.model, short.runner.kv_caches)
    out["avx512_kit"] = "built"
except RuntimeError as e:
    out["avx512_kit"] = str(e)
json.dump(out, open(sys.argv[2], "w"))
"""


@pytest.fixture(scope="module")
def avx2_run(tmp_path_factory) -> tuple[dict, dict[str, Path]]:
    if not quant_kernel.avx2_blocked_available():
        pytest.skip("this CPU has no AVX2")
    tmp = tmp_path_factory.mktemp("avx2")
    folder = make_tiny_model(tmp, "llama", tokenizer=False, hidden_size=256, intermediate_size=512,
                             vocab_size=VOCAB, num_attention_heads=4, num_key_value_heads=2)
    paths = {name: write_tiny_gguf(folder, tmp / f"{name}.gguf", quant=lambda n, m=MIXES[name]: type_of(m, n))
             for name in CHECKED}
    env = {**os.environ, cpu_isa.ISA_ENV: "avx2", "OMP_NUM_THREADS": "1"}
    report = tmp / "report.json"
    run = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(IDS), str(report), *map(str, paths.values())],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(report.read_text()), paths


def test_the_cap_leaves_avx2_and_fp32_gemms(avx2_run):
    report, _ = avx2_run
    assert report["kernel"] == "avx2" and report["bf16_native"] is False
    assert report["kit"] == decode_step.KITS["avx2"]
    assert "AVX512-VNNI kernels do not run on this CPU" in report["avx512_kit"], report["avx512_kit"]


@pytest.mark.parametrize("mix", CHECKED)
def test_every_kernel_type_runs_on_the_avx2_kernel(avx2_run, mix):
    report, paths = avx2_run
    layers = report[str(paths[mix])]
    for part in ("o_proj", "down"):
        kind = type_of(MIXES[mix], part)
        assert layers[part].startswith(kind) and "column-blocked AVX2 kernel" in layers[part], layers[part]
        assert "fp32 GEMM from 128 rows" in layers[part], layers[part]  # prompts: not a bf16 GEMM
    # decode steps run the fused step on its AVX2 kit (the 8-row prompt ran in it)
    assert layers["fused"] is True and layers["stack_kit"] == decode_step.KITS["avx2"]


@pytest.mark.parametrize("mix", CHECKED)
def test_fast_mode_on_avx2_agrees_with_exact(avx2_run, mix):
    # test_gguf_mixes.test_fast_mode_agrees_with_exact's criteria, on both prompt paths.
    _, paths = avx2_run
    fast = torch.load(str(paths[mix]) + ".fast.pt")
    exact = all_logits(engine(paths[mix], "exact"), IDS)
    for name, rows in (("prompt", len(IDS)), ("short", 8)):
        f, e = fast[name], exact[:rows]
        assert (f - e).abs().max() < 0.05 * e.abs().max(), name
        top2 = e.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * (f - e).abs().amax(-1)
        agree = f.argmax(-1) == e.argmax(-1)
        assert agree[clear].all() and agree.float().mean() >= 0.9, name


def test_an_unknown_cap_is_named(monkeypatch):
    monkeypatch.setenv(cpu_isa.ISA_ENV, "avx3")
    with pytest.raises(ValueError, match="TOKENMILL_CPU_ISA='avx3' is not one of baseline, avx2, avx512, amx"):
        cpu_isa.cap()
    monkeypatch.setenv(cpu_isa.ISA_ENV, "AVX2")
    assert cpu_isa.cap() == "avx2"
