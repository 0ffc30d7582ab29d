"""`tokenmill bench fidelity`: exact mode's greedy tokens against transformers' fp32 on the same file.

Issue 23's first target (and issue 22's "greedy output stays token-identical to transformers on the
same file"), on a real file: the suite checks it on tiny random-weight models and on the bundled
SmolLM2 (tests/test_gemma.py, tests/test_fidelity.py); this command checks any GGUF or folder that
transformers loads, such as Gemma 3 270M with prompts shorter and longer than its sliding window.

Prompts are consecutive slices of the held-out text at the token lengths asked for, BOS first where
the model's tokenizer adds one. transformers' greedy continuation of each is the reference, and the engine
must give it token for token in five runs: all prompts at once, each alone on a cold cache, each
again from the prefix cache, all at once in small prefill chunks, and all at once in a pool that
holds only the longest request, so that requests are preempted and recomputed. After every run the
engine must be idle with no page held. The exit status is 1 when any prompt differs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tokenmill.bench.arg_types import at_least
from tokenmill.errors import InvalidRequest

# The token budget a step of the "chunked" run (and at most that of the "preempted" one): a
# 1,700-token prompt takes 18 steps to prefill, and the shorter prompts are admitted beside it.
CHUNK_TOKENS = 96


@dataclass(frozen=True)
class FidelityRun:
    """One way of serving the prompts and what it gave."""

    name: str
    matches: list[bool]  # per prompt: the engine's greedy tokens equal transformers'
    preemptions: int
    prefix_hit_tokens: int
    seconds: float
    expects: str | None = None  # "preemptions" / "prefix_hit_tokens": the run tests nothing without some

    @property
    def exercised(self) -> bool:
        return self.expects is None or getattr(self, self.expects) > 0

    @property
    def passed(self) -> bool:
        return all(self.matches) and self.exercised


def add_fidelity_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "fidelity", help="exact mode's greedy tokens vs transformers fp32 on the same file: together, alone, "
                         "prefix-cached, chunked, preempted")
    p.add_argument("--model", default=None, help="GGUF file or Hugging Face folder (default: bundled SmolLM2-135M)")
    p.add_argument("--prompt-tokens", type=token_lengths, default=token_lengths("8,360,900,1700"),
                   help="comma-separated prompt lengths in tokens, cut from the held-out text (default: shorter "
                        "and longer than Gemma 3's 512-token window)")
    p.add_argument("--new-tokens", type=at_least(1), default=16, help="greedy tokens generated per prompt")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--json", metavar="PATH", default=None, help="write settings and results here")
    p.set_defaults(func=cmd_fidelity)


def token_lengths(text: str) -> list[int]:
    """An argparse type: comma-separated prompt lengths, each at least 2 tokens (BOS and one more)."""
    try:
        lengths = [int(n) for n in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts such as 8,360, got {text!r}") from None
    if not lengths or min(lengths) < 2:
        raise argparse.ArgumentTypeError(f"every prompt needs at least 2 tokens, got {text!r}")
    return lengths


def slice_prompts(text_ids: Sequence[int], lengths: Sequence[int], lead: Sequence[int]) -> list[list[int]]:
    """Consecutive slices of `text_ids` after `lead` (the tokens the model puts first, such as BOS),
    each `length` tokens long in all."""
    prompts, start = [], 0
    lead = list(lead)
    for length in lengths:
        take = length - len(lead)
        if take < 1 or start + take > len(text_ids):
            raise InvalidRequest(f"cannot cut a {length}-token prompt: the held-out text has {len(text_ids)} tokens "
                             f"and the prompts before it took {start}")
        prompts.append(lead + list(text_ids[start:start + take]))
        start += take
    return prompts


def transformers_greedy(model: Any, prompts: Sequence[Sequence[int]], new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, alone, EOS not stopping it."""
    model.generation_config.eos_token_id = None  # ignore_eos, as the engine runs
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = model.generate(torch.tensor([list(p)]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            out.append(ids[0, len(p):].tolist())
    return out


def pool_for_preemption(llm: Any, longest: int, chunk_tokens: int) -> int:
    """kv_cache_tokens of the smallest pool that still holds the longest request on its own in prefill
    chunks of `chunk_tokens` (every KV group counted: kvcache/kv_groups.py). Requests admitted chunk by
    chunk beside it outgrow such a pool, so some must be preempted and recomputed."""
    from tokenmill.kvcache.kv_groups import KVLayout

    scheduler = llm.engine.scheduler
    layout = scheduler.layout or KVLayout.single(1)
    page_size = scheduler.pool.page_size
    pages = next(n for n in itertools.count(1)
                 if layout.capacity_tokens(n, page_size, chunk_tokens) >= longest)
    return pages * page_size


def run_fidelity(model: str, prompts: list[list[int]], references: list[list[int]], new_tokens: int,
                 engine_args: dict[str, Any], log: Callable[[str], None] = print) -> list[FidelityRun]:
    """The five runs of the module docstring, each on the engine it needs, in exact mode."""
    from tokenmill.entrypoints.llm import LLM
    from tokenmill.sample.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    runs: list[FidelityRun] = []

    def serve(name: str, llm: Any, batches: list[list[int]], expects: str | None = None) -> None:
        before = llm.stats()
        start = time.perf_counter()
        matches = []
        for batch in batches:
            outs = llm.generate([{"prompt_token_ids": prompts[i]} for i in batch], params)
            matches += [o.outputs[0].token_ids == references[i] for o, i in zip(outs, batch)]
        llm.check_integrity()
        after = llm.stats()
        if after["kv_pages_in_use"] != 0:
            raise AssertionError(f"{name}: {after['kv_pages_in_use']} KV pages still held by an idle engine")
        runs.append(FidelityRun(name, matches, after["num_preemptions"] - before["num_preemptions"],
                                after["prefix_cache_hit_tokens_total"] - before["prefix_cache_hit_tokens_total"],
                                time.perf_counter() - start, expects))
        log(f"  {name}: {sum(matches)} / {len(matches)} prompts token-identical"
            + ("" if runs[-1].exercised else f"; no {expects.replace('_', ' ')}: the run did not test them"))

    everyone = list(range(len(prompts)))
    each = [[i] for i in everyone]
    exact = {**engine_args, "precision": "exact"}
    llm = LLM(model, **exact)
    serve("all together", llm, [everyone])
    serve("each alone, again: from the prefix cache", llm, each, expects="prefix_hit_tokens")
    longest = max(len(p) for p in prompts) + new_tokens
    # The longest request must take several chunks, or the others simply wait for it: no preemption.
    chunk = min(CHUNK_TOKENS, max(llm.engine.scheduler.pool.page_size, longest // 4))
    pool = pool_for_preemption(llm, longest, chunk)
    del llm
    serve("each alone, cold", LLM(model, **exact, enable_prefix_caching=False), each)
    serve(f"all together in chunks of {CHUNK_TOKENS} tokens", LLM(model, **exact, max_num_batched_tokens=CHUNK_TOKENS),
          [everyone])
    serve(f"in chunks of {chunk}, a pool of {pool} tokens (preempted)",
          LLM(model, **exact, max_num_batched_tokens=chunk, kv_cache_tokens=pool), [everyone],
          expects="preemptions")
    return runs


def cmd_fidelity(args: argparse.Namespace) -> int:
    """Exit status 0 when every run matched and exercised its case, 1 otherwise; bad input is an
    InvalidRequest (the CLI prints it, status 2)."""
    from tokenmill.bench.quality import held_out_text_path
    from tokenmill.bench.throughput import load_transformers_peer
    from tokenmill.frontend.tokenizer import Tokenizer
    from tokenmill.model.default_model import default_model_path

    model = os.path.abspath(os.path.expanduser(args.model)) if args.model else default_model_path()
    lengths = args.prompt_tokens
    tokenizer = Tokenizer.from_model_path(model)
    with open(held_out_text_path(), encoding="utf-8") as f:
        text_ids = tokenizer.encode(f.read(), add_special_tokens=False)
    # encode("") is what the model's own rule puts before any text (BOS, or nothing)
    prompts = slice_prompts(text_ids, lengths, tokenizer.encode(""))
    start = time.perf_counter()
    references = transformers_greedy(load_transformers_peer(model), prompts, args.new_tokens)
    print(f"{model}: transformers fp32, {len(prompts)} prompts of {lengths} tokens, {args.new_tokens} greedy tokens "
          f"each, in {time.perf_counter() - start:.1f} s")
    engine_args = {"page_size": args.page_size, "num_threads": args.num_threads}
    runs = run_fidelity(model, prompts, references, args.new_tokens, engine_args)
    print(f"  {'run (exact mode)':58s} {'identical':>9s} {'preempted':>9s} {'cached':>7s} {'seconds':>7s}")
    for r in runs:
        print(f"  {r.name:58s} {sum(r.matches):>5d} / {len(r.matches)} {r.preemptions:9d} {r.prefix_hit_tokens:7d} "
              f"{r.seconds:7.1f}")
    passed = all(r.passed for r in runs)
    print(f"  greedy token-identical to transformers in every run, each run exercised: {'yes' if passed else 'NO'}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"settings": vars(args) | {"func": None}, "prompt_tokens": lengths, "passed": passed,
                       "runs": [vars(r) | {"passed": r.passed, "exercised": r.exercised} for r in runs]}, f, indent=1)
    return 0 if passed else 1
