"""The memory a prompt step reuses instead of faulting in again: the thread's weight scratch
(model/kernels/weight_scratch.py) that large steps dequantize each weight into, the `*_into` ops that
write it, and the malloc thresholds a step-running process sets (engine/memory_trim.py)."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch
import torch.nn.functional as F

from tests.engine.fake_runner import make_engine, run_to_completion
from tests.model.test_block_decoders import weight
from tokenmill.engine import memory_trim
from tokenmill.model.kernels import quant_kernel, weight_scratch
from tokenmill.model.layers.quantized_linear import BLOCKED_DENSE_MIN_ROWS, QuantizedLinear
from tokenmill.model.quant import quantize_int4
from tokenmill.model.runner import ModelRunner
from tokenmill.sample.sampling_params import SamplingParams


@pytest.fixture(autouse=True)
def no_scratch():
    weight_scratch.release()
    yield
    weight_scratch.release()


def test_a_thread_reuses_its_buffer_and_grows_it_only_for_a_larger_weight():
    a = weight_scratch.take(64, 128, torch.bfloat16)
    assert a.shape == (64, 128) and a.dtype == torch.bfloat16 and a.is_contiguous()
    ptr = a.data_ptr()
    b = weight_scratch.take(32, 128, torch.float32)  # the same 16 kB, read as fp32
    assert b.data_ptr() == ptr and weight_scratch.held_bytes() == 64 * 128 * 2
    c = weight_scratch.take(128, 128, torch.bfloat16)  # larger: a new buffer, the only one kept
    assert weight_scratch.held_bytes() == 128 * 128 * 2
    assert weight_scratch.take(16, 16, torch.bfloat16).data_ptr() == c.data_ptr()


def test_release_drops_the_buffers_but_not_a_view_in_use():
    view = weight_scratch.take(8, 8, torch.float32)
    view.copy_(torch.arange(64.0).reshape(8, 8))
    assert weight_scratch.release() == 8 * 8 * 4 and weight_scratch.held_bytes() == 0
    assert torch.equal(view, torch.arange(64.0).reshape(8, 8))  # still its own memory
    assert weight_scratch.take(8, 8, torch.float32).data_ptr() != view.data_ptr()


def test_each_thread_has_its_own_buffer():
    ptrs = {}
    both_hold_theirs = threading.Barrier(2)  # a thread that ended may hand its id (and buffer) on

    def grab(name: str) -> None:
        ptrs[name] = weight_scratch.take(256, 256, torch.bfloat16).data_ptr()
        if name != "main":
            both_hold_theirs.wait(timeout=30)

    threads = [threading.Thread(target=grab, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    grab("main")
    assert len(set(ptrs.values())) == 3 and weight_scratch.held_bytes() == 3 * 256 * 256 * 2


def test_prompt_gemm_reads_the_scratch_and_gives_the_dequantized_product():
    bw, ref, _ = weight("Q4_1", 64, 512)  # a format whose prompt steps take the bf16 GEMM (registry)
    layer = QuantizedLinear(bw, None)
    if layer.prompt_gemm not in ("bf16", "fp32"):
        pytest.skip(f"prompt steps run the {layer.prompt_gemm} kernel here, not a GEMM over a dense copy")
    dtype = torch.bfloat16 if layer.prompt_gemm == "bf16" else torch.float32
    x = torch.randn(BLOCKED_DENSE_MIN_ROWS + 8, 512)
    expected = F.linear(x.to(dtype), ref.to(dtype)).float()
    first = layer(x).float()
    ptr = weight_scratch.take(1, 1, torch.uint8).data_ptr()
    second = layer(x).float()
    assert torch.equal(first, expected) and torch.equal(second, expected)
    assert weight_scratch.take(1, 1, torch.uint8).data_ptr() == ptr  # one buffer for both calls
    assert weight_scratch.held_bytes() == 64 * 512 * dtype.itemsize


@pytest.mark.skipif(not quant_kernel.available(), reason="the row-layout kernel is not built here")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_row_layout_dequantize_into_equals_the_allocating_op(dtype):
    qw = quantize_int4(torch.randn(48, 256))
    out = quant_kernel.dense_scratch(qw, dtype)
    assert torch.equal(out, quant_kernel.dequantize(qw, dtype))


def test_a_wrong_buffer_is_a_named_error():
    bw, _, _ = weight("Q4_K", 64, 512)
    ops = torch.ops.tokenmill_vnni if quant_kernel.blocked_kernel() == "vnni" else torch.ops.tokenmill_avx2
    into = ops.dequantize_bf16_into if quant_kernel.blocked_kernel() == "vnni" else ops.dequantize_into
    right = torch.bfloat16 if quant_kernel.blocked_kernel() == "vnni" else torch.float32
    wrong = torch.float32 if right == torch.bfloat16 else torch.bfloat16
    args = quant_kernel.blocked_args(bw)
    with pytest.raises(RuntimeError, match="out must be"):
        into(torch.empty(64, 512, dtype=wrong), *args, 512)
    with pytest.raises(RuntimeError, match=r"out must be a contiguous \[64, 512\] tensor"):
        into(torch.empty(64, 256, dtype=right), *args, 512)
    with pytest.raises(RuntimeError, match="not contiguous"):
        into(torch.empty(512, 64, dtype=right).t(), *args, 512)


def test_the_engine_drops_the_scratch_when_its_last_request_finishes():
    engine, runner = make_engine()
    real, counted = runner.execute, runner.release_idle_memory
    held = []

    def execute(chunks):  # a large step's layers: the weight copy is taken during the step
        weight_scratch.take(64, 64, torch.bfloat16)
        held.append((weight_scratch.held_bytes(), runner.idle_releases))
        return real(chunks)

    def release_idle_memory():  # counted, and what a model's runner does
        counted()
        ModelRunner.release_idle_memory(runner)

    runner.execute, runner.release_idle_memory = execute, release_idle_memory
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0))
    engine.add_request("b", [4, 5], SamplingParams(max_tokens=6, temperature=0))
    run_to_completion(engine)
    assert held == [(64 * 64 * 2, 0)] * 6  # kept while requests ran
    assert weight_scratch.held_bytes() == 0 and runner.idle_releases == 1  # and dropped once none is left


# A fresh process frees and allocates the same 24 MB block twice: with glibc's defaults the first
# block is mapped on its own and unmapped on free, and the second comes from a heap that grows for
# it, so both fault every page in; with keep_step_memory's thresholds the second reuses the first's.
_PROBE = """
import ctypes, resource, sys
from tokenmill.engine.memory_trim import keep_step_memory
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
if sys.argv[1] == "keep":
    assert keep_step_memory()
faults = []
for _ in range(2):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(24 << 20); ctypes.memset(p, 1, 24 << 20); libc.free(p)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
print(faults[1])
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or memory_trim._glibc is None, reason="glibc only")
def test_keep_step_memory_lets_the_next_step_reuse_freed_pages():
    def second_round_faults(mode: str) -> int:
        run = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True)
        return int(run.stdout.split()[-1])

    pages = (24 << 20) // 4096
    assert second_round_faults("default") > pages // 2
    assert second_round_faults("keep") < pages // 20
