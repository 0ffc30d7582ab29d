"""The fused decode step (csrc/decode_step.cpp) computes what the layers do op by op: the same logits
to float rounding, the same K/V written to the same slots, for plain decode rows and speculative runs,
with bf16 and fp32 caches, on each blocked kernel's kit (AVX512-VNNI, and AVX2 as CPUs without
AVX-512 run it); and a bad slot or page is an error, not a wild write."""

from __future__ import annotations

import pytest
import torch

from tests.model.conftest import one_term_rows, one_term_slack
from tests.tiny_models import make_tiny_model, write_tiny_gguf
from tokenmill.config import EngineConfig
from tokenmill.engine.factory import build_engine_core
from tokenmill.model.attention import AttentionMetadata
from tokenmill.model.fused_decode import FusedDecodeStack
from tokenmill.model.kernels import decode_step, quant_kernel
from tokenmill.model.kv_cache_format import KVCacheFormat
from tokenmill.model.layers.quantized_linear import BLOCKED_DENSE_MIN_ROWS
from tokenmill.model.runner import BF16_PROMPT_MIN_ROWS, ModelRunner, SeqChunk

pytestmark = pytest.mark.skipif(not decode_step.available(), reason="needs the C++ kernels and a blocked kernel")


@pytest.fixture(scope="module", params=["Q4_1", "Q8_0", "int8"])
def fast_runner(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    folder = make_tiny_model(tmp, "llama", tokenizer=False, hidden_size=128, intermediate_size=256)
    if request.param == "int8":  # a dense checkpoint quantized at load
        model, quantization = str(folder), "int8"
    else:
        model, quantization = str(write_tiny_gguf(folder, tmp / "tiny.gguf", quant=request.param)), "auto"

    def build(kv_dtype: torch.dtype = torch.bfloat16, prompt_gemm: str = "auto", page_size: int = 16) -> ModelRunner:
        config = EngineConfig(model=model, precision="fast", quantization=quantization, num_threads=2,
                              kv_cache_tokens=512, prompt_gemm=prompt_gemm, page_size=page_size)
        runner = build_engine_core(config).runner
        return ModelRunner(runner.model, runner.num_pages, runner.page_size, kv_dtype, prefill_as_decode_rows=True)

    build.kind = request.param
    return build


def ids(n: int, seed: int) -> list[int]:
    return [int(i) for i in torch.randint(100, 250, (n,), generator=torch.Generator().manual_seed(seed))]


def prefill(runner: ModelRunner, prompts: list[list[int]]) -> list[list[int]]:
    """Prompts computed op by op (chunks longer than the decode-row limit); each one's pages."""
    size = runner.page_size
    pages, first = [], 0
    for p in prompts:
        n = -(-(len(p) + 8) // size)  # room for the decode rows too
        pages.append(list(range(first, first + n)))
        first += n
    runner.execute([SeqChunk(p, 0, pg, sample=True) for p, pg in zip(prompts, pages)])
    return pages


def decode_chunks(prompts, pages) -> list[SeqChunk]:
    # one plain decode row, a speculative run of 4 tokens (last token + 3 drafts), another plain row
    return [
        SeqChunk(ids(1, 10), len(prompts[0]), pages[0], sample=True),
        SeqChunk(ids(4, 11), len(prompts[1]), pages[1], sample=True, num_logits=4),
        SeqChunk(ids(1, 12), len(prompts[2]), pages[2], sample=True),
    ]


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float32])
def test_fused_step_matches_the_layers_op_by_op(fast_runner, kv_dtype, kernel):
    runner = fast_runner(kv_dtype)
    model = runner.model
    assert model.fused_decode, "the tiny quantized llama should take the fused path"
    assert any("fused C++ call" in line for line in model.describe())  # the start-up log says so
    prompts = [ids(37, 1), ids(21, 2), ids(50, 3)]
    pages = prefill(runner, prompts)
    chunks = decode_chunks(prompts, pages)

    fused = runner.execute(chunks)
    assert model._decode_stack is not None  # the step really went through the C++ stack
    assert model._decode_stack.kit == decode_step.KITS[kernel]  # the layers' kernel's kit
    fused_kv = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    model.fused_decode = False
    eager = runner.execute(chunks)  # rewrites the same slots op by op

    assert fused.shape == eager.shape == (1 + 4 + 1, model.config.vocab_size)
    torch.testing.assert_close(fused, eager, atol=2e-4 * eager.abs().max().item(), rtol=1e-4)
    assert torch.equal(fused.argmax(-1), eager.argmax(-1))
    for (kf, vf), (ke, ve) in zip(fused_kv, runner.kv_caches):
        torch.testing.assert_close(kf.float(), ke.float(), atol=1e-4, rtol=1e-2)
        torch.testing.assert_close(vf.float(), ve.float(), atol=1e-4, rtol=1e-2)


def split_parts(runner: ModelRunner, pages: list[int], length: int) -> int:
    """How many parts the attention kernel cuts a row of `length` positions into on 2 threads."""
    c = runner.model.config
    items = torch.ops.tokenmill_cpu.decode_attention_items(torch.tensor([pages]), torch.tensor([length]),
                                                           runner.page_size, c.num_heads, c.num_kv_heads, c.head_dim, 2)
    return int(items[:, 4].max())


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8])
def test_a_long_row_split_between_threads_matches_op_by_op(fast_runner, kv_dtype):
    # batch-1 decode at 301 positions on pages of 8: each KV head's pages in two parts, one a thread,
    # merged before o
    runner = fast_runner(kv_dtype, page_size=8)
    model = runner.model
    prompt = ids(300, 7)
    pages = prefill(runner, [prompt])
    assert split_parts(runner, pages[0], len(prompt) + 1) == 2
    chunk = [SeqChunk(ids(1, 13), len(prompt), pages[0], sample=True)]
    fused = runner.execute(chunk)
    assert model._decode_stack is not None
    fused_kv = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    model.fused_decode = False
    try:
        eager = runner.execute(chunk)
    finally:
        model.fused_decode = True
    torch.testing.assert_close(fused, eager, atol=2e-4 * eager.abs().max().item(), rtol=1e-4)
    values = KVCacheFormat.of(kv_dtype).decode  # int8 rows: a code may round the other way
    for (kf, vf), (ke, ve) in zip(fused_kv, runner.kv_caches):
        torch.testing.assert_close(values(kf), values(ke), atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(values(vf), values(ve), atol=2e-2, rtol=1e-2)


def prompt_as_rows(runner: ModelRunner, n: int, seed: int) -> list[SeqChunk]:
    """One prompt of n tokens from position 0 with all its logits: one fused step of runs of rows."""
    return [SeqChunk(ids(n, seed), 0, list(range(-(-n // runner.page_size))), sample=True, all_logits=True)]


def fused_then_eager(runner: ModelRunner, chunks: list[SeqChunk]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the fused step's logits, the layers' op by op) for the same chunks."""
    model = runner.model
    model._decode_stack = None
    fused = runner.execute(chunks)
    assert model._decode_stack is not None  # the step really went through the C++ stack
    model.fused_decode = False
    try:
        return fused, runner.execute(chunks)
    finally:
        model.fused_decode = True


@pytest.mark.skipif(not quant_kernel.amx_available(), reason="no AMX-BF16 here")
def test_steps_of_many_rows_run_the_amx_tiles_as_the_layers_do(fast_runner):
    """A fused step of amx_min_rows+ rows multiplies on the AMX tiles (its rows split once per layer
    input), as the op-by-op linears do: it agrees with them far closer than with the VNNI kernel's."""
    runner = fast_runner()
    model = runner.model
    chunk = prompt_as_rows(runner, int(torch.ops.tokenmill_vnni.amx_min_rows()) + 16, 21)
    fused, eager = fused_then_eager(runner, chunk)
    linears = [lin for layer in model.layers for lin in layer.linears() if getattr(lin, "kernel_weight", None) is not None]
    assert linears
    model.fused_decode = False
    try:
        for lin in linears:  # the same layers with the VNNI kernel at every row count
            lin._blocked = lambda x, w=lin.kernel_weight: quant_kernel.blocked_linear(x, w, amx=False)
        vnni = runner.execute(chunk)
    finally:
        model.fused_decode = True
        for lin in linears:
            lin._blocked = quant_kernel.bound_blocked_linear(lin.kernel_weight)
    torch.testing.assert_close(fused, eager, atol=2e-4 * eager.abs().max().item(), rtol=1e-4)
    assert (fused - eager).abs().max() < 0.25 * (fused - vnni).abs().max()


def test_large_steps_run_op_by_op(fast_runner):
    runner = fast_runner()
    prefill(runner, [ids(FusedDecodeStack.MAX_ROWS + 1, 4)])
    assert runner.model._decode_stack is None  # the linears' bf16 GEMM rows: never the fused path
    prefill(runner, [ids(40, 4)])
    assert runner.model._decode_stack is not None  # a short prompt is (its rows attend as decode rows)


def test_bad_slot_or_page_is_an_error(fast_runner):
    runner = fast_runner()
    model = runner.model
    stack = model._stack_for(runner.kv_caches)
    hidden, hd = model.config.hidden_size, model.config.head_dim
    x = torch.randn(1, hidden)
    cos, sin = torch.ones(1, hd), torch.zeros(1, hd)
    num_slots = runner.kv_caches[0][0].shape[1]

    def meta(slot: int, page: int) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=torch.tensor([slot]), num_decode=1, page_size=runner.page_size,
                                 decode_block_table=torch.tensor([[page]]), decode_mask=None, prefills=[],
                                 decode_seq_lens=torch.tensor([1]))

    with pytest.raises(RuntimeError, match="outside the cache"):
        stack.run(x.clone(), cos, sin, meta(num_slots, 0))
    with pytest.raises(RuntimeError, match="outside the pool"):
        stack.run(x.clone(), cos, sin, meta(0, runner.num_pages))
    out = stack.run(x.clone(), cos, sin, meta(0, 0))  # and a good step still runs
    assert out.shape == (1, hidden) and torch.isfinite(out).all()


def test_a_kit_this_cpu_cannot_run_is_an_error(fast_runner, monkeypatch):
    runner = fast_runner()
    monkeypatch.setattr(decode_step, "kit", lambda: 7)
    with pytest.raises(RuntimeError, match=r"kit must be 0 \(AVX512-VNNI\) or 1 \(AVX2\), not 7"):
        FusedDecodeStack(runner.model, runner.kv_caches)
    # an AVX2 CPU asked for the AVX-512 kit: tests/model/test_avx2_path.py


def test_prompts_attend_through_the_paged_kernel_as_through_sdpa(fast_runner):
    """Fast mode sends prompt chunks through the paged kernel as runs of rows (and, when few enough,
    through the fused step): the logits of every prompt token, over two chunks of one prompt and a
    second prompt beside them, agree with the SDPA path's."""
    kernel_runner = fast_runner()
    sdpa_runner = ModelRunner(kernel_runner.model, kernel_runner.num_pages, kernel_runner.page_size, torch.bfloat16)
    first, rest, other = ids(45, 5), ids(30, 6), ids(70, 7)
    # every chunk below as rows (on AMX CPUs, long ones would go to bf16 SDPA instead:
    # tests/model/test_prompt_attention.py); the plain runner sends them as prefill spans
    for tokens, start in ((first, 0), (other, 0), (rest, len(first))):
        chunk = SeqChunk(tokens, start, [], sample=True)
        assert kernel_runner.attends_as_rows(chunk) and not sdpa_runner.attends_as_rows(chunk)
    results = []
    for runner in (kernel_runner, sdpa_runner):
        a = runner.execute([SeqChunk(first, 0, list(range(0, 8)), sample=True, all_logits=True),
                            SeqChunk(other, 0, list(range(8, 16)), sample=True, all_logits=True)])
        b = runner.execute([SeqChunk(rest, len(first), list(range(0, 8)), sample=True, all_logits=True)])
        results.append(torch.cat([a, b]))
    got, ref = results
    # 2e-3 of the largest logit; on AMX the tiles' one bf16 term for Q8_0 blocks moved some by 3.4e-3
    # of it (conftest.one_term_slack)
    slack = one_term_slack(fast_runner.kind)
    torch.testing.assert_close(got, ref, atol=2e-3 * slack * ref.abs().max().item(), rtol=1e-3)
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.98


def test_prompt_steps_take_the_path_of_their_format(fast_runner):
    """By default prompt steps of 4-bit codes (Q4_1) run the bf16 GEMM with bf16 activations between
    the layers; 8-bit codes (Q8_0, int8) keep the file's values on the kernel, whose AMX tiles (from
    amx_min_rows() rows) take bf16 activations as they are, else fp32. The engine setting puts every
    format on one path."""
    model = fast_runner().model
    tiles = one_term_rows("Q8_0")  # the AMX tiles', or the vector tiles' without AMX
    one_term = fast_runner.kind in ("Q8_0", "int8")
    if fast_runner.kind == "Q4_1":
        assert model.bf16_rows == BLOCKED_DENSE_MIN_ROWS
    else:
        assert model.bf16_rows == tiles
    assert any("bf16 activations" in line for line in model.describe()) == (model.bf16_rows is not None)
    vnni = fast_runner(prompt_gemm="vnni").model
    assert vnni.bf16_rows == (tiles if one_term else None)
    assert any("bf16 activations" in line for line in vnni.describe()) == (vnni.bf16_rows is not None)


def test_one_term_tiles_take_bf16_activations_bit_for_bit(fast_runner):
    """Q8_0 weights (and int8, quantized into Q8_0 blocks) on the tiles multiply bf16(x) alone:
    a prompt step handing them bf16 activations (norms, attention and the silu epilogue writing bf16)
    gives exactly the logits of float32 activations rounded by each linear."""
    if fast_runner.kind == "Q4_1" or one_term_rows("Q8_0") is None:
        pytest.skip("the tiles take bf16 as it is only for one-term formats (AMX, or AVX512-BF16's vector tiles)")
    runner = fast_runner(prompt_gemm="vnni")
    model = runner.model
    assert model.bf16_rows == one_term_rows("Q8_0") and all(model.bf16_layers)
    # shorter prompts are one fused C++ call (decode rows: up to BF16_PROMPT_MIN_ROWS - 1 where prompts
    # attend on the AMX tiles, else any length, but the fused stack takes fewer rows than these)
    first = min(runner.max_rows_as_decode, BF16_PROMPT_MIN_ROWS - 1) + 1
    for n in (first, first + 21):  # whole tiles of rows; a partial last tile
        chunk = [SeqChunk(ids(n, seed=n), 0, list(range(0, 16)), sample=True, all_logits=True)]
        got = runner.execute(chunk)
        rows, model.bf16_rows = model.bf16_rows, None
        ref = runner.execute(chunk)
        model.bf16_rows = rows
        assert torch.equal(got, ref)


def test_large_steps_keep_activations_in_bf16_with_the_same_results(fast_runner):
    """From the linears' bf16-GEMM row count on, the fused ops pass bf16 activations straight to
    and from the GEMMs instead of converting them to float32 and back: the same numbers, up to the
    order in which a norm adds its squares (prompt steps on the bf16 GEMM, asked for: the default
    only for 4-bit formats)."""
    runner = fast_runner(prompt_gemm="bf16")
    model = runner.model
    assert model.bf16_rows == FusedDecodeStack.MAX_ROWS + 1
    assert_bf16_activations_change_nothing(runner, seed=8)


def assert_bf16_activations_change_nothing(runner: ModelRunner, seed: int) -> None:
    """A prompt step past the model's bf16 row count gives the logits it gives with float32
    activations everywhere (each GEMM converting its input and output), up to bf16 rounding order."""
    model = runner.model
    prompt = ids(model.bf16_rows + 20, seed)
    chunk = [SeqChunk(prompt, 0, list(range(0, 16)), sample=True, all_logits=True)]
    got = runner.execute(chunk)
    model.bf16_rows = None
    ref = runner.execute(chunk)
    torch.testing.assert_close(got, ref, atol=2e-2 * ref.abs().max().item(), rtol=1e-2)
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.95


def test_a_mix_keeps_bf16_activations_in_the_layers_that_take_them(tmp_path):
    """A mix with one 8-bit matrix (a Q8_0 down_proj in layer 1 of a Q4_1 file, as llama-quantize's
    IQ4_XS keeps Q5_K in a few layers) keeps bf16 activations in the other layers' prompt steps,
    and the one layer converts around its GEMMs: the same numbers as float32 activations
    everywhere."""
    folder = make_tiny_model(tmp_path, "llama", tokenizer=False, hidden_size=128, intermediate_size=256,
                             num_hidden_layers=3)
    mix = write_tiny_gguf(folder, tmp_path / "mix.gguf",
                          quant=lambda name: "Q8_0" if name == "model.layers.1.mlp.down_proj.weight" else "Q4_1")
    config = EngineConfig(model=str(mix), precision="fast", num_threads=2, kv_cache_tokens=512)
    runner = build_engine_core(config).runner
    model = runner.model
    assert model.bf16_rows == BLOCKED_DENSE_MIN_ROWS
    assert model.bf16_layers == [True, False, True]
    assert any("bf16 activations" in line and "in 2 of 3 layers" in line for line in model.describe())
    assert_bf16_activations_change_nothing(runner, seed=9)
