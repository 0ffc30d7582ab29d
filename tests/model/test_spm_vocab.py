"""The SentencePiece tokenizer built from GGUF metadata gives llama.cpp's ids: against a transcription
of llama.cpp's algorithm on a small made-up vocabulary, and against llama.cpp itself on Gemma 3's
(when both the file and the llama-tokenize tool are on this machine)."""

from __future__ import annotations

import random
import subprocess

import pytest

from tests.gemma_model import gemma_gguf_or_skip, llama_tokenize_or_skip
from tokenmill.model.spm_vocab import BYTE, CONTROL, NORMAL, USER_DEFINED, build_spm_tokenizer

SPACE = "\u2581"


def made_up_vocab():
    """Byte tokens, characters, merged pieces with scores that make greedy order matter."""
    tokens, scores, types = ["<unk>", "<s>", "</s>", "<ctl>", "\n\n"], [0.0] * 5, [2, CONTROL, CONTROL, CONTROL,
                                                                             USER_DEFINED]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    scores += [0.0] * 256
    types += [BYTE] * 256
    pieces = list("abcde\n") + [SPACE, "ab", "bc", "abc", "cd", "de", "cde", SPACE + "a", SPACE + "ab",
                                "aa", "aaa", "ea", SPACE + SPACE, "é"]
    rng = random.Random(1)
    for piece in pieces:
        tokens.append(piece)
        scores.append(-float(rng.randint(1, 50)) if len(piece) > 1 else -100.0)
        types.append(NORMAL)
    meta = {"tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.add_bos_token": True}
    return meta, tokens, scores, types


def llama_cpp_spm(text: str, tokens, scores, types, add_space_prefix: bool) -> list[int]:
    """llama-vocab.cpp's SPM path, transcribed: split at control / user-defined tokens, then for each
    piece of text merge the best-scored adjacent pair (leftmost on ties), bytes for what is left."""
    vocab = {t: i for i, t in enumerate(tokens)}
    specials = sorted((t for t, k in zip(tokens, types) if k in (CONTROL, USER_DEFINED, 2)), key=len, reverse=True)
    fragments: list[str | int] = [text]
    for special in specials:
        out: list[str | int] = []
        for frag in fragments:
            if isinstance(frag, int):
                out.append(frag)
                continue
            parts = frag.split(special)
            for j, part in enumerate(parts):
                if part:
                    out.append(part)
                if j < len(parts) - 1:
                    out.append(vocab[special])
        fragments = out
    ids, prev_special = [1], True
    for frag in fragments:
        if isinstance(frag, int):
            ids.append(frag)
            prev_special = True
            continue
        piece = ((" " if add_space_prefix and prev_special else "") + frag).replace(" ", SPACE)
        prev_special = False
        symbols = list(piece)
        while True:
            best = None
            for i in range(len(symbols) - 1):
                merged = symbols[i] + symbols[i + 1]
                if merged in vocab and (best is None or scores[vocab[merged]] > best[0]):
                    best = (scores[vocab[merged]], i)
            if best is None:
                break
            i = best[1]
            symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
        for s in symbols:
            ids.extend([vocab[s]] if s in vocab else [vocab[f"<0x{b:02X}>"] for b in s.encode()])
    return ids


@pytest.mark.parametrize("add_space_prefix", [False, True])
def test_ids_follow_llama_cpp_merging_on_a_made_up_vocabulary(add_space_prefix):
    meta, tokens, scores, types = made_up_vocab()
    tok = build_spm_tokenizer({**meta, "tokenizer.ggml.add_space_prefix": add_space_prefix}, tokens, scores, types)
    rng = random.Random(0)
    alphabet = list("abcde  \n") + ["\n\n", "<ctl>", "é", "x", "中"]
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 14)))
        assert tok.encode(text).ids == llama_cpp_spm(text, tokens, scores, types, add_space_prefix), repr(text)
    # Bytes for what the vocabulary cannot spell, spaces back on decode.
    assert tok.decode(tok.encode("ab 中x").ids, skip_special_tokens=True) == "ab 中x"


def test_same_ids_as_llama_cpp_on_gemma3():
    path = gemma_gguf_or_skip()
    tool = llama_tokenize_or_skip()
    from tokenmill.model.tokenizer_files import load_tokenizer_files

    tok = load_tokenizer_files(path).backend
    texts = ["The capital of France is", "def fibonacci(n):\n    return n  # two spaces\n\n\tdone",
             "请用中文介绍一下长城的历史。", "My favourite emojis are 🎉🚀🐍", " leading and trailing  ",
             "<start_of_turn>user\nhi<end_of_turn>\n"]
    for text in texts:
        out = subprocess.run([tool, "-m", path, "-p", text, "--ids", "--log-disable"], capture_output=True, text=True,
                             check=True).stdout
        line = [ln for ln in out.splitlines() if ln.startswith("[")][-1]
        assert tok.encode(text).ids == [int(x) for x in line.strip("[]").split(",") if x.strip()], repr(text)
