"""`tokenmill bench spec` end to end at tiny sizes: both engines run, outputs compared, numbers reported."""

from __future__ import annotations

import json

import pytest

from tokenmill.bench.spec import DEFAULT_DATASET, NEAR_TIE_NATS, _divergence
from tokenmill.entrypoints.cli import main

pytestmark = pytest.mark.slow


def test_bench_spec_reports_both_engines_and_acceptance(tmp_path, capsys):
    assert DEFAULT_DATASET.is_file()  # the shipped workload
    data = tmp_path / "w.jsonl"
    lines = DEFAULT_DATASET.read_text().splitlines()[:2] + [json.dumps({"prompt": "a b c a b c a b c a b"})]
    data.write_text("\n".join(lines) + "\n")
    out_json = tmp_path / "r.json"
    code = main(["bench", "spec", "--dataset", str(data), "--max-tokens", "12", "--streams", "3", "--repeats", "1",
                 "--num-threads", "1", "--kv-cache-tokens", "4096", "--num-speculative-tokens", "3",
                 "--json", str(out_json)])
    assert code == 0
    report = json.loads(out_json.read_text())
    assert report["greedy_identical"] == "3/3"
    assert report["settings"]["speculative"]["method"] == "ngram"
    assert report["acceptance_batch1"]["num_draft_tokens"] > 0
    assert all(v > 0 for v in report["batch1_decode_tok_s"].values())
    assert "batch 1 decode tok/s" in capsys.readouterr().out


def test_bench_spec_rejects_a_missing_dataset(tmp_path):
    with pytest.raises(SystemExit, match="no workload"):
        main(["bench", "spec", "--dataset", str(tmp_path / "none.jsonl"), "--num-threads", "1"])


class _ScoringLLM:
    """Answers the divergence probe with fixed logprobs for the next token."""

    def __init__(self, top: list[tuple[int, float]]) -> None:
        self.top, self.asked = top, []

    def generate(self, prompts, params, use_tqdm=False):
        from types import SimpleNamespace

        from tokenmill.sample.logprobs import TokenLogprobs

        self.asked.append(prompts[0]["prompt_token_ids"])
        lp = TokenLogprobs(self.top[0][0], self.top[0][1], 1, self.top)
        return [SimpleNamespace(outputs=[SimpleNamespace(logprobs=[lp])])]


def test_a_divergence_is_measured_where_the_outputs_part():
    llm = _ScoringLLM([(7, -0.70), (9, -0.72), (3, -3.0)])
    d = _divergence(llm, [1, 2], [5, 6, 7, 8], [5, 6, 9, 4])
    assert llm.asked == [[1, 2, 5, 6]]  # the prompt and the common prefix, scored by the plain engine
    assert d["position"] == 2 and d["margin_nats"] == pytest.approx(0.02) and d["margin_nats"] <= NEAR_TIE_NATS
    far = _divergence(_ScoringLLM([(7, -0.1), (9, -2.5)]), [1], [7], [9])
    assert far["margin_nats"] == pytest.approx(2.4) and far["margin_nats"] > NEAR_TIE_NATS  # a real change: fails
    assert _divergence(_ScoringLLM([(7, -0.1)]), [1], [7], [3])["margin_nats"] == float("inf")  # not in the top
