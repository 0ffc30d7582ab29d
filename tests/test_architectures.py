"""Each supported architecture, as a tiny random-weight model, gives transformers' logits in fp32:
for a whole prompt at once, and token by token through the paged KV cache (mixed with another
sequence in the same flat batch)."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import ARCHS, make_tiny_model, reference_model
from tokenmill.model.loader import load_weights
from tokenmill.model.registry import model_class
from tokenmill.model.runner import ModelRunner, SeqChunk

# Logits of these models are O(1); fp32 differences from summation order stay around 1e-6.
ATOL = 1e-4

PROMPT = [17, 300, 4021, 99, 12000, 7, 7, 42, 31337, 500, 1024, 2048, 5, 6, 77, 48000, 3, 250, 9000, 11]


def build(folder, page_size: int = 4) -> ModelRunner:
    loaded = load_weights(str(folder))
    model = model_class(loaded.config.architecture)(loaded.config, loaded.weights, max_positions=256)
    return ModelRunner(model, num_pages=32, page_size=page_size)


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(tmp_path, arch):
    folder = make_tiny_model(tmp_path, arch, tokenizer=False)
    with torch.inference_mode():
        ref = reference_model(folder)(torch.tensor([PROMPT])).logits[0]
    runner = build(folder)

    # Whole prompt in one chunk: logits of its last token.
    pages = list(range(8))
    whole = runner.execute([SeqChunk(PROMPT, 0, pages, sample=True)])
    torch.testing.assert_close(whole[0], ref[-1], atol=ATOL, rtol=0)

    # Again in a second sequence: a prefill chunk of 12, then one token per step (decode rows),
    # while a third sequence prefills in the same steps.
    other = list(range(8, 16))
    runner.execute([SeqChunk(PROMPT[:12], 0, other, sample=True)])
    third = list(range(16, 24))
    for pos in range(12, len(PROMPT)):
        logits = runner.execute(
            [SeqChunk([PROMPT[pos]], pos, other, sample=True), SeqChunk(PROMPT[:pos], 0, third, sample=True)]
        )
        torch.testing.assert_close(logits[0], ref[pos], atol=ATOL, rtol=0)
        torch.testing.assert_close(logits[1], ref[pos - 1], atol=ATOL, rtol=0)


def test_prefill_chunk_after_cached_context(tmp_path):
    """A later prefill chunk attends to the cached context with an offset causal mask."""
    folder = make_tiny_model(tmp_path, "llama", tokenizer=False)
    with torch.inference_mode():
        ref = reference_model(folder)(torch.tensor([PROMPT])).logits[0]
    runner = build(folder, page_size=3)
    pages = list(range(10))
    runner.execute([SeqChunk(PROMPT[:7], 0, pages, sample=False)])
    logits = runner.execute([SeqChunk(PROMPT[7:], 7, pages, sample=True)])
    torch.testing.assert_close(logits[0], ref[-1], atol=ATOL, rtol=0)
