"""Mixture-of-experts GGUF files (llama.cpp's merged expert tensors) through the whole engine.

Tiny Qwen3-MoE, Qwen2-MoE (shared expert) and Mixtral (a `llama` file with experts) models written
by the test (tests/moe_gguf.py) in mixes of types like llama-quantize's: the experts are views of
the file's map; exact mode is token-identical to transformers reading the file's values, alone,
batched, chunked and preempted; fast mode, each expert on its kernel, agrees with exact. A file
made by llama.cpp's own convert_hf_to_gguf.py loads too, where the peer tree is unpacked.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.engine.fake_runner import run_to_completion
from tests.moe_gguf import write_moe_gguf
from tests.tiny_models import make_tiny_model, reference_model
from tokenmill.config import EngineConfig
from tokenmill.engine.engine_core import EngineCore
from tokenmill.engine.factory import build_engine_core
from tokenmill.model.layers.quantized_linear import QuantizedLinear
from tokenmill.model.loader import load_weights
from tokenmill.model.moe import MoEDecoderLayer
from tokenmill.model.quant_formats import GGUFWeight
from tokenmill.model.runner import SeqChunk
from tokenmill.sample.sampling_params import SamplingParams

VOCAB = 1024
PROMPTS = [[5, 300, 17, 912, 44, 610, 2, 77, 801, 13, 99, 400], [7, 8, 9], [42] * 5, [600, 3, 1000, 27]]
NEW = 8
SIZES = {"vocab_size": VOCAB, "hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 4,
         "num_key_value_heads": 2}
# family -> (config overrides, {part of the HF name: type}; "" is every other matrix). Routing as
# llama.cpp does it per family: Qwen3-MoE and Mixtral renormalise the top-k, Qwen2-MoE does not.
CASES = {
    "qwen3_moe": ({"moe_intermediate_size": 256, "mlp_only_layers": [], "norm_topk_prob": True},
                  {"embed": "Q4_K", "lm_head": "Q6_K", "v_proj": "Q6_K", "o_proj": "Q5_0",
                   "down_proj": "Q6_K", "": "Q4_K"}),
    "qwen2_moe": ({"moe_intermediate_size": 256, "shared_expert_intermediate_size": 256, "norm_topk_prob": False},
                  {"gate_proj": "Q4_0", "up_proj": "Q4_1", "shared_expert.": "Q5_1", "": "Q8_0"}),
    "mixtral": ({}, {"embed": "Q5_K", "lm_head": "Q6_K", "w1": "IQ4_XS", "w3": "IQ4_XS", "w2": "Q5_K", "": "Q5_K"}),
}


def type_of(mix: dict[str, str], name: str) -> str:
    return next((kind for part, kind in mix.items() if part and part in name), mix[""])


@pytest.fixture(scope="module", params=sorted(CASES))
def moe_file(request, tmp_path_factory):
    arch = request.param
    overrides, mix = CASES[arch]
    tmp = tmp_path_factory.mktemp(arch)
    folder = make_tiny_model(tmp, arch, tokenizer=False, **SIZES, **overrides)
    path, ref_folder = write_moe_gguf(folder, tmp / f"{arch}.gguf", lambda name: type_of(mix, name))
    ref = reference_model(ref_folder)
    greedy = []
    with torch.inference_mode():
        for p in PROMPTS:
            out = ref.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
            greedy.append(out[0, len(p):].tolist())
    return arch, path, ref, greedy, mix


def engine(path: Path, precision: str = "exact", **kwargs) -> EngineCore:
    # The files carry no vocabulary: the engine core alone, fed token ids.
    return build_engine_core(EngineConfig(model=str(path), precision=precision, num_threads=1, **kwargs))


def run(core: EngineCore, prompts) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(str(i), p, params)
    out = run_to_completion(core)
    return [out[str(i)] for i in range(len(prompts))]


def test_experts_are_views_of_the_file_in_its_types(moe_file):
    arch, path, ref, _, mix = moe_file
    loaded = load_weights(str(path))
    c = loaded.config
    assert c.architecture == arch and c.moe is not None
    assert (c.moe.num_experts, c.moe.top_k, c.moe.expert_intermediate_size) == (4, 2, 256)
    assert c.moe.norm_topk_prob == CASES[arch][0].get("norm_topk_prob", True)
    assert c.moe.shared_expert_intermediate_size == (256 if arch == "qwen2_moe" else 0)
    file_map = np.memmap(path, mode="r", dtype=np.uint8)
    experts = {n: w for n, w in loaded.weights.items() if ".experts." in n}
    assert len(experts) == 2 * 4 * 3
    for name, w in experts.items():
        assert isinstance(w, GGUFWeight) and w.kind == type_of(mix, name) == loaded.gguf_types[name]
        # no copy: the expert's bytes are where the file holds them
        assert isinstance(w.raw, np.memmap) and not w.raw.flags.owndata
        assert np.shares_memory(w.raw, w.raw.base) and len(w.raw.base) == len(file_map)
        torch.testing.assert_close(w.dequantize(), ref.state_dict()[_fused_name(name)][_expert_rows(name)])


def _fused_name(name: str) -> str:
    # transformers 5 holds an MoE block's experts fused: [experts, 2 * width, hidden] gate then up.
    layer = name.split(".")[2]
    proj = name.rsplit(".", 2)[-2]
    fused = "down_proj" if proj in ("down_proj", "w2") else "gate_up_proj"
    return f"model.layers.{layer}.mlp.experts.{fused}"


def _expert_rows(name: str) -> tuple:
    expert, proj = int(name.split(".")[5]), name.rsplit(".", 2)[-2]
    if proj in ("up_proj", "w3"):
        return (expert, slice(256, 512))
    return (expert, slice(0, 256)) if proj in ("gate_proj", "w1") else (expert,)


def test_exact_logits_match_transformers(moe_file):
    _, path, ref, _, _ = moe_file
    core = engine(path, kv_cache_tokens=256)
    assert all(isinstance(layer, MoEDecoderLayer) for layer in core.runner.model.layers)
    prompt = PROMPTS[0]
    with torch.inference_mode():
        expected = ref(torch.tensor([prompt])).logits[0]
    got = core.runner.execute([SeqChunk(prompt, 0, [0], sample=True, all_logits=True)])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_exact_greedy_alone_batched_chunked_preempted(moe_file):
    _, path, _, greedy, _ = moe_file
    core = engine(path, kv_cache_tokens=512)
    assert [run(core, [p])[0] for p in PROMPTS] == greedy
    assert run(core, PROMPTS) == greedy
    chunked = engine(path, kv_cache_tokens=512, max_num_batched_tokens=4, enable_prefix_caching=False)
    assert run(chunked, PROMPTS) == greedy
    tight = engine(path, kv_cache_tokens=32, page_size=4, enable_prefix_caching=False)
    assert run(tight, PROMPTS) == greedy
    assert tight.scheduler.num_preemptions > 0


def test_fast_mode_runs_experts_on_their_kernels_and_agrees_with_exact(moe_file):
    _, path, _, greedy, mix = moe_file
    fast = engine(path, "fast", kv_cache_tokens=512)
    block = fast.runner.model.layers[0].moe_block
    assert all(isinstance(e.down, QuantizedLinear) and type_of(mix, "w2.down_proj") in e.down.weight.kind
               for e in block.experts)
    got = run(fast, PROMPTS)
    same = sum(a == b for g, e in zip(got, greedy) for a, b in zip(g, e))
    assert same >= 0.8 * NEW * len(PROMPTS), (got, greedy)


@pytest.mark.parametrize("prompt_gemm", ["vnni", "bf16"])
def test_fast_mode_long_prompt_agrees_with_exact(tmp_path, prompt_gemm):
    # 240 rows in one step. With prompt steps on the bf16 GEMM (the default for 4-bit formats only, so
    # asked for here: Q8_0's default is the kernel) the dense parts hand the experts bf16 rows, which each expert (a share of the rows,
    # on the packed kernel) takes in fp32. Mixtral in Q8_0: llama's attention, so the fused ops and
    # their bf16 rows apply (not to Qwen3's q/k norms or Qwen2's biases).
    folder = make_tiny_model(tmp_path, "mixtral", tokenizer=False, **SIZES)
    path, _ = write_moe_gguf(folder, tmp_path / "q8.gguf", lambda name: "Q8_0")
    prompt = [int(i) for i in torch.randint(3, VOCAB, (240,), generator=torch.Generator().manual_seed(2))]
    logits = []
    for precision in ("fast", "exact"):
        core = engine(path, precision, kv_cache_tokens=512, prompt_gemm=prompt_gemm)
        assert precision == "exact" or (core.runner.model.bf16_rows is not None) == (prompt_gemm == "bf16")
        logits.append(core.runner.execute([SeqChunk(prompt, 0, list(range(16)), sample=True, all_logits=True)]))
    fast, exact = logits
    assert (fast.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.9


CONVERTER = Path.home() / ".cache/tokenmill-peers/llama.cpp-0.3.36/convert_hf_to_gguf.py"


@pytest.mark.skipif(not CONVERTER.exists(), reason="llama.cpp's tree is not unpacked")
def test_a_file_made_by_llama_cpps_converter_is_token_identical(tmp_path):
    # Mixtral: a `llama` file whose expert_count makes it MoE, q/k rows permuted by the converter.
    folder = make_tiny_model(tmp_path, "mixtral")
    out = tmp_path / "mixtral-f32.gguf"
    subprocess.run([sys.executable, str(CONVERTER), str(folder), "--outtype", "f32", "--outfile", str(out)],
                   check=True, capture_output=True)
    prompt = PROMPTS[0]
    with torch.inference_mode():
        want = reference_model(folder).generate(torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW,
                                                do_sample=False)[0, len(prompt):].tolist()
    assert run(engine(out, kv_cache_tokens=256), [prompt])[0] == want
