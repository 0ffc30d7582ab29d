"""Per-step cost of structured output: bitmask fill + apply (+ accept) for 16 JSON-schema rows, against
the step. Run: OMP_NUM_THREADS=1 .venv/bin/python -m tests.sample.bench_grammar (bundled model)."""

from __future__ import annotations

import statistics
import time

from tests.real_model import make_llm
from tokenmill.sample import grammar
from tokenmill.sample.sampling_params import SamplingParams, StructuredOutputParams

ROWS = 16
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 5},
        "address": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
    "required": ["name", "age", "tags", "address"],
}


def run(llm, constrained: bool) -> tuple[list[float], list[float]]:
    masks: list[float] = []
    apply = grammar.XGrammarBackend.apply

    def timed(self, logits, matchers, rows):  # fill + apply, as the sampler calls it
        t = time.perf_counter()
        apply(self, logits, matchers, rows)
        masks.append(time.perf_counter() - t)

    grammar.XGrammarBackend.apply = timed
    so = StructuredOutputParams(json_schema=SCHEMA) if constrained else None
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=48, ignore_eos=not constrained, structured_output=so)
    engine = llm.engine
    for i in range(ROWS):
        ids = llm.chat_prompt_ids([{"role": "user", "content": f"Person #{i} as JSON."}])
        engine.add_request(f"{constrained}-{i}", ids, params)
    steps: list[float] = []
    while engine.has_unfinished():
        t = time.perf_counter()
        outs = engine.step()
        # decode steps with all 16 rows only (prefill steps and the ragged tail are not comparable)
        if len(outs) == ROWS and all(len(engine.requests.get(o.request_id).output_token_ids) > 1
                                     for o in outs if not o.finished):
            steps.append(time.perf_counter() - t)
    grammar.XGrammarBackend.apply = apply
    return steps, masks


def main() -> None:
    llm = make_llm(num_threads=1, kv_cache_tokens=16384)
    run(llm, True)  # warm-up: loads the xgrammar backend, compiles the schema
    free_steps, _ = run(llm, False)
    steps, masks = run(llm, True)
    med = statistics.median
    print(f"rows={ROWS} decode steps: free {med(free_steps) * 1e3:.1f} ms, constrained {med(steps) * 1e3:.1f} ms")
    print(f"mask fill+apply per step: median {med(masks) * 1e3:.2f} ms, max {max(masks) * 1e3:.2f} ms "
          f"({med(masks) / med(steps):.1%} of the constrained step)")


if __name__ == "__main__":
    main()
