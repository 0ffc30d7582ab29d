"""Writes spec_workload.jsonl: prompts whose answers repeat their input, for `tokenmill bench spec`.

Two kinds of editing, where the answer is the input again, mostly verbatim: rename an identifier in
a code file, and correct the spelling of a text (a summary "with quotes" was tried first: the bundled
135M model paraphrases instead of quoting, so it measured nothing). The code is generated from
templates with a fixed seed; the texts are paragraphs of the held-out text shipped for `bench
quality`, with a few letters swapped. Run it again to regenerate the same file.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
HELDOUT = HERE.parents[1] / "src" / "tokenmill" / "entrypoints" / "data" / "heldout.txt"
SEED = 20261201

NOUNS = ["order", "invoice", "sensor", "packet", "ticket", "record", "sample", "route", "player", "batch"]
VERBS = ["load", "parse", "merge", "score", "filter", "render", "update", "validate", "count", "group"]


def code_file(rng: random.Random) -> tuple[str, str, str]:
    noun = rng.choice(NOUNS)
    funcs = []
    for verb in rng.sample(VERBS, 4):
        arg = rng.choice(["items", "values", "rows", "entries"])
        limit = rng.randrange(2, 50)
        funcs.append(
            f"def {verb}_{noun}s({arg}, limit={limit}):\n"
            f"    result = []\n"
            f"    for {noun} in {arg}:\n"
            f"        if len(result) >= limit:\n"
            f"            break\n"
            f"        if {noun} is not None:\n"
            f"            result.append({noun})\n"
            f"    return result\n"
        )
    new = rng.choice([n for n in NOUNS if n != noun])
    return "\n\n".join(funcs), noun, new


def with_typos(text: str, rng: random.Random, count: int = 4) -> str:
    """Swaps two adjacent letters in `count` longer words: the answer is the text again, nearly verbatim."""
    words = text.split(" ")
    for i in rng.sample([i for i, w in enumerate(words) if len(w) > 5 and w.isalpha()], count):
        w = words[i]
        j = rng.randrange(1, len(w) - 2)
        words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2 :]
    return " ".join(words)


def main() -> None:
    rng = random.Random(SEED)
    paragraphs = [p for p in HELDOUT.read_text().split("\n\n") if len(p) > 400]
    rows = []
    for i in range(8):
        if i % 2 == 0:
            code, old, new = code_file(rng)
            content = (
                f"Here is a Python file:\n\n```python\n{code}```\n\nRename the variable `{old}` to `{new}` "
                "everywhere and output the complete updated file in a code block."
            )
        else:
            text = with_typos(rng.choice(paragraphs), rng)
            content = (
                f"Correct the spelling mistakes in the following text and output the corrected text in "
                f"full:\n\n{text}"
            )
        rows.append({"id": f"spec-{i}", "messages": [{"role": "user", "content": content}]})
    with open(HERE / "spec_workload.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
