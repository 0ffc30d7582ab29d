"""Tiny GGUF files mixing tensor types the way llama-quantize does (Q4_K_M, Q5_K_M, Q6_K, Q3_K_M,
IQ4_XS, Q2_K, a mix of the 1- and 2-bit types newer than gguf-py with MXFP4, and a mix with types that have no
kernel), written by the test, through the whole engine: exact mode greedy-identical to transformers
reading the same file (for the newer types, which transformers cannot read, the same model written
with their exact fp32 values), fast mode agreeing with exact, each matrix run as the kernels' layout
or the documented bf16 fallback, and the draft model of speculative decoding loading the same way.

Shapes are tiny but K-quant-able (rows of 256 and 512 weights). Types gguf-py can quantize hold the
tiny model's own weights; the others hold random blocks with the weights' spread (tests/gguf_blocks.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.engine.fake_runner import run_to_completion
from tests.tiny_models import make_tiny_model, write_tiny_gguf
from tokenmill.config import EngineConfig
from tokenmill.engine.factory import build_engine_core
from tokenmill.model.layers.dense_linear import DenseLinear
from tokenmill.model.layers.factory import kernel_types
from tokenmill.model.layers.quantized_linear import QuantizedLinear
from tokenmill.model.quant_formats.newer_types import NEWER_TYPES
from tokenmill.model.runner import SeqChunk
from tokenmill.sample.sampling_params import SamplingParams

VOCAB = 1024
# mix -> {part of the HF name: type}; "" is every other matrix.
MIXES: dict[str, dict[str, str]] = {
    "Q4_K_M": {"embed": "Q4_K", "lm_head": "Q6_K", "v_proj": "Q6_K", "down": "Q6_K", "o_proj": "Q5_0",
               "gate": "Q8_0", "": "Q4_K"},
    "Q5_K_M": {"embed": "Q5_K", "lm_head": "Q6_K", "v_proj": "Q6_K", "down": "Q6_K", "o_proj": "Q5_1", "": "Q5_K"},
    "Q6_K": {"lm_head": "Q8_0", "": "Q6_K"},
    "Q3_K_M": {"embed": "Q3_K", "lm_head": "Q6_K", "v_proj": "Q5_K", "down": "Q4_K", "o_proj": "Q4_0", "": "Q3_K"},
    "IQ4_XS": {"lm_head": "Q6_K", "o_proj": "IQ4_NL", "": "IQ4_XS"},
    "Q2_K": {"embed": "Q2_K", "lm_head": "Q6_K", "v_proj": "Q3_K", "down": "Q4_K", "gate": "Q4_1", "": "Q2_K"},
    # ggml's 1-bit and 2-bit types (gguf-py 0.19 cannot dequantize Q1_0 nor read Q2_0), and MXFP4
    "Q1_0": {"embed": "Q2_0", "lm_head": "Q6_K", "down": "Q2_0", "v_proj": "Q2_0", "gate": "MXFP4", "": "Q1_0"},
    # no kernel for IQ2_XXS / IQ3_S / TQ2_0: bf16 with a warning; F16 / BF16 stay 16-bit
    "no-kernel": {"embed": "F16", "lm_head": "BF16", "q_proj": "IQ2_XXS", "down": "IQ3_S", "up": "TQ2_0", "": "Q4_K"},
}
SIXTEEN_BITS = {"F16": torch.float16, "BF16": torch.bfloat16}
PROMPT = [5, 300, 17, 912, 44, 610, 2, 77]


def type_of(mix: dict[str, str], name: str) -> str:
    return next((kind for part, kind in mix.items() if part and part in name), mix[""])


@pytest.fixture(scope="module", params=sorted(MIXES))
def mix_file(request, tmp_path_factory) -> tuple[str, Path, Path]:
    tmp = tmp_path_factory.mktemp(request.param)
    folder = make_tiny_model(tmp, "llama", tokenizer=False, hidden_size=256, intermediate_size=512,
                             vocab_size=VOCAB, num_attention_heads=4, num_key_value_heads=2)
    mix = MIXES[request.param]
    twin = tmp / f"{request.param}-fp32.gguf" if set(mix.values()) & set(NEWER_TYPES) else None
    path = write_tiny_gguf(folder, tmp / f"{request.param}.gguf", quant=lambda name: type_of(mix, name),
                           dense_twin=twin)
    return request.param, folder, path


def engine(path: Path, precision: str, **kwargs):
    return build_engine_core(EngineConfig(model=str(path), precision=precision, num_threads=1,
                                          kv_cache_tokens=256, **kwargs))


def greedy(core, prompt: list[int], n: int) -> list[int]:
    core.add_request("0", prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return run_to_completion(core)["0"]


def transformers_greedy(folder: Path, path: Path, prompt: list[int], n: int) -> list[int]:
    # from_pretrained(gguf_file=...) needs accelerate; this is the function it calls to dequantize,
    # rename and un-permute the file's tensors (gguf-py's arithmetic).
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(os.fspath(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def all_logits(core, ids: list[int]) -> torch.Tensor:
    pages = list(range(-(-len(ids) // core.runner.page_size)))
    return core.runner.execute([SeqChunk(ids, 0, pages, sample=True, all_logits=True)])


def test_exact_mode_is_token_identical_to_transformers(mix_file):
    _, folder, path = mix_file
    twin = path.with_name(path.stem + "-fp32.gguf")  # the values of a file transformers cannot read
    reference = transformers_greedy(folder, twin if twin.exists() else path, PROMPT, 12)
    assert greedy(engine(path, "exact"), PROMPT, 12) == reference


def test_fast_mode_runs_each_matrix_as_its_kernel_or_bf16(mix_file, caplog):
    name, _, path = mix_file
    mix = MIXES[name]
    with caplog.at_level("WARNING", logger="tokenmill.model.builder"):
        model = engine(path, "fast").runner.model
    layer = model.layers[0]
    kernels = kernel_types()
    for linear, part in ((layer.o_proj, "o_proj"), (layer.down, "down"), (model.lm_head, "lm_head")):
        kind = type_of(mix, part)
        if kind in kernels:
            assert isinstance(linear, QuantizedLinear) and kind in linear.weight.kind, (part, kind)
        elif kind in ("F16", "BF16"):
            assert isinstance(linear, DenseLinear) and linear.weight.dtype == SIXTEEN_BITS[kind]
        else:  # no kernel: bf16 (the lm_head fp32, for its logits)
            dtype = torch.float32 if part == "lm_head" else torch.bfloat16
            assert isinstance(linear, DenseLinear) and linear.weight.dtype == dtype, (part, kind)
    lacking = sorted({type_of(mix, p) for p in ("embed", "lm_head", "q_proj", "k_proj", "v_proj", "o_proj",
                                                  "gate", "up", "down")} - kernels - {"F16", "BF16"})
    lines = [r.getMessage() for r in caplog.records if "without a CPU kernel" in r.getMessage()]
    assert len(lines) == (1 if lacking else 0)
    for kind in lacking:
        assert f"{kind} (" in lines[0]


def test_fast_mode_agrees_with_exact(mix_file):
    # Fast mode differs from exact only by rounding: activations as two int8 terms (~15 bits) in the
    # kernels, bf16 for matrices without one, for 192+-row GEMMs and in the KV cache. On these random
    # tiny models a logit moves by at most a few percent of the largest one (measured: 0.2-1 % on the
    # kernels, 2 % with bf16 fallbacks), so the top-1 token may change only where exact's top two are
    # closer than twice the largest error: elsewhere it must agree, and overall at least 90 % of 40
    # teacher-forced positions (measured: all of them, every mix).
    _, _, path = mix_file
    ids = [int(i) for i in torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(1))]
    fast, exact = all_logits(engine(path, "fast"), ids), all_logits(engine(path, "exact"), ids)
    assert (fast - exact).abs().max() < 0.05 * exact.abs().max()
    top2 = exact.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * (fast - exact).abs().amax(-1)
    agree = fast.argmax(-1) == exact.argmax(-1)
    assert agree[clear].all() and agree.float().mean() >= 0.9


def test_a_draft_model_of_the_same_file_loads_the_same_way(mix_file):
    # The draft proposer builds its model through the same loader and factory; with greedy decoding
    # speculation never changes what is emitted.
    name, _, path = mix_file
    if name not in ("Q4_K_M", "no-kernel"):
        pytest.skip("one kernel mix and the fallback mix are enough here")
    spec = {"method": "draft", "draft_precision": "fast", "num_speculative_tokens": 3}
    plain = greedy(engine(path, "exact"), PROMPT, 10)
    assert greedy(engine(path, "exact", speculative=spec), PROMPT, 10) == plain
