"""Logits processors that run before greedy/random selection: min_tokens, bad words, logit bias, penalties.

All work in place on a contiguous [rows, vocab] tensor the sampler owns (never the caller's logits) and
touch only the (row, token) pairs concerned, so their cost follows the number of listed / seen tokens,
not the vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from tokenmill.sample.sampling_batch import BatchPlan, SamplingBatch

_NEG_INF = float("-inf")
# Drop history entries of requests not seen for this many steps (finished, aborted, preempted).
_EVICT_AFTER_STEPS = 8


class LogitsProcessors:
    """Steps 1-4 of the sampler's order. Holds per-request token-count histories across steps."""

    def __init__(self, eos_token_ids: Sequence[int]) -> None:
        self.eos_token_ids = list(eos_token_ids)
        self.history = PenaltyHistory()

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch, plan: BatchPlan) -> None:
        vocab = logits.shape[1]
        params = batch.params
        if plan.min_tokens:
            # vLLM masks EOS even with ignore_eos: min_tokens promises that many tokens either way.
            _fill(
                logits,
                vocab,
                ((r, self.eos_token_ids + list(params[r].stop_token_ids or ())) for r in plan.min_tokens),
            )
        if plan.bad_words:
            _fill(logits, vocab, ((r, params[r].bad_words_token_ids or ()) for r in plan.bad_words))
        if plan.logit_bias:
            _add_bias(logits, vocab, ((r, params[r].logit_bias or {}) for r in plan.logit_bias))
        if plan.penalties:
            self.history.apply(logits, batch, plan.penalties)


def _fill(logits: torch.Tensor, vocab: int, rows_ids: Iterable[tuple[int, Iterable[int]]]) -> None:
    rows: list[int] = []
    cols: list[int] = []
    for r, ids in rows_ids:
        ids = [t for t in ids if t < vocab]  # ids beyond these logits cannot be sampled anyway
        rows.extend([r] * len(ids))
        cols.extend(ids)
    if cols:
        dev = logits.device
        logits.index_put_(
            (torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
            torch.tensor(_NEG_INF, dtype=logits.dtype, device=dev),
        )


def _add_bias(logits: torch.Tensor, vocab: int, rows_bias: Iterable[tuple[int, dict[int, float]]]) -> None:
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    for r, bias in rows_bias:
        for t, b in bias.items():
            if t < vocab:
                rows.append(r)
                cols.append(t)
                vals.append(b)
    if cols:
        dev = logits.device
        idx = (torch.tensor(rows, device=dev), torch.tensor(cols, device=dev))
        logits.index_put_(idx, torch.tensor(vals, dtype=logits.dtype, device=dev), accumulate=True)


class _History:
    """Unique tokens of one request with their counts in its output (prompt-only tokens count 0)."""

    __slots__ = ("prompt", "output", "with_prompt", "seen", "last", "keys", "counts", "size", "pos", "step")

    def __init__(self, prompt: list[int], output: list[int], with_prompt: bool, step: int) -> None:
        # Holding the lists keeps their id() from being reused by another request while cached.
        self.prompt = prompt
        self.output = output
        self.with_prompt = with_prompt
        self.step = step
        out = np.asarray(output, dtype=np.int64)
        allt = np.concatenate([np.asarray(prompt, dtype=np.int64), out]) if with_prompt else out
        keys, inverse = np.unique(allt, return_inverse=True)
        counts = np.bincount(inverse[len(allt) - len(out) :], minlength=len(keys)).astype(np.float32)
        self.keys, self.counts, self.size = keys, counts, len(keys)
        self.pos: dict[int, int] | None = None  # built on the first incremental update
        self._mark_seen()

    def _mark_seen(self) -> None:
        self.seen = len(self.output)
        self.last = self.output[-1] if self.output else None

    def valid_for(self, prompt: list[int], output: list[int], with_prompt: bool) -> bool:
        n = len(output)
        return (
            self.output is output
            and self.prompt is prompt
            and self.with_prompt == with_prompt
            and n >= self.seen
            and (self.seen == 0 or output[self.seen - 1] == self.last)
        )

    def catch_up(self) -> None:
        """Count the tokens appended since the last step (usually one)."""
        new = self.output[self.seen :]
        if not new:
            return
        if self.pos is None:
            self.pos = dict(zip(self.keys[: self.size].tolist(), range(self.size)))
        for t in new:
            i = self.pos.get(t)
            if i is None:
                if self.size == len(self.keys):  # amortised doubling, like list.append
                    self.keys = np.resize(self.keys, max(16, 2 * self.size))
                    self.counts = np.resize(self.counts, len(self.keys))
                i = self.size
                self.pos[t] = i
                self.keys[i] = t
                self.counts[i] = 0.0
                self.size += 1
            self.counts[i] += 1.0
        self._mark_seen()


class PenaltyHistory:
    """repetition / frequency / presence penalties, vLLM v1 semantics.

    Per request it keeps the unique tokens and their output counts, keyed on the identity of the
    request's output list (the engine appends to the same list every step), so a step costs
    O(new tokens + unique tokens) instead of re-reading the whole prompt and output. Any mismatch
    (a new list, a shortened one, a changed tail) falls back to rebuilding from the lists.
    """

    def __init__(self) -> None:
        self._entries: dict[int, _History] = {}
        self._step = 0

    def _get(self, prompt: list[int], output: list[int], with_prompt: bool) -> _History:
        entry = self._entries.get(id(output))
        if entry is not None and entry.valid_for(prompt, output, with_prompt):
            entry.catch_up()
            entry.step = self._step
        else:
            entry = _History(prompt, output, with_prompt, self._step)
            self._entries[id(output)] = entry
        return entry

    def apply(self, logits: torch.Tensor, batch: SamplingBatch, rows: list[int]) -> None:
        self._step += 1
        keys, counts, sizes, coefs = [], [], [], []
        for r in rows:
            p = batch.params[r]
            # The prompt only matters to the repetition penalty (OpenAI/vLLM: frequency and presence
            # look at the output alone), so skip building its token set when it is off.
            h = self._get(batch.prompt_token_ids[r], batch.output_token_ids[r], p.repetition_penalty != 1.0)
            keys.append(h.keys[: h.size])
            counts.append(h.counts[: h.size])
            sizes.append(h.size)
            coefs.append((p.repetition_penalty, p.frequency_penalty, p.presence_penalty))
        if self._step % _EVICT_AFTER_STEPS == 0:
            old = self._step - _EVICT_AFTER_STEPS
            self._entries = {k: e for k, e in self._entries.items() if e.step > old}
        if not sum(sizes):
            return
        # Index arithmetic in numpy: cheaper than a handful of small torch ops per step.
        vocab = logits.shape[1]
        key = np.concatenate(keys)
        cnt = np.concatenate(counts)
        pos = key + np.repeat(np.asarray(rows, dtype=np.int64) * vocab, sizes)
        coef = np.repeat(np.asarray(coefs, dtype=np.float32), sizes, axis=0)
        if key.max() >= vocab:  # prompt ids beyond these logits: nothing to penalise
            keep = key < vocab
            pos, cnt, coef = pos[keep], cnt[keep], coef[keep]
        dev = logits.device
        pos_t = torch.from_numpy(pos).to(dev)
        cnt_t = torch.from_numpy(cnt).to(dev, logits.dtype)
        rep_t, freq_t, pres_t = torch.from_numpy(coef).to(dev, logits.dtype).unbind(dim=1)
        # Flat 1-D gather/scatter: several times faster on CPU than 2-D advanced indexing.
        flat = logits.view(-1)  # the sampler's own contiguous copy
        v = flat.index_select(0, pos_t)
        # HF/vLLM repetition penalty: shrink positive logits, push negative ones further down.
        v = torch.where(v > 0, v / rep_t, v * rep_t)
        v = v - freq_t * cnt_t - pres_t * (cnt_t > 0).to(v.dtype)
        flat.index_copy_(0, pos_t, v)
