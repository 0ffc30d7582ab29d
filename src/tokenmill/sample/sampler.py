"""Turns one step's logits into tokens, with vLLM (v1) semantics.

Processor order, per row:
  0. grammar (structured output): tokens the row's grammar forbids -> -inf, first, so every step below
     (penalties, top_k/top_p, the draw) works on the allowed tokens only; EOS passes only where the
     grammar may end.
  1. min_tokens: while len(output) < min_tokens, EOS ids and stop_token_ids -> -inf (also with ignore_eos,
     as vLLM does).
  2. bad_words_token_ids -> -inf.
  3. logit_bias added.
  4. penalties: repetition over prompt + output tokens (logit > 0: divide, else multiply); frequency
     (minus penalty x count) and presence (minus penalty if count > 0) over output tokens only.
  5. greedy rows (temperature < 1e-5, vLLM's epsilon): argmax of the processed logits; on ties the first
     maximum, like torch/transformers. Greedy rows consume no randomness.
  6. random rows: logits / temperature, then min_p (probability < min_p x max probability -> -inf), then
     top_k, then top_p on the distribution renormalised over what is left; top_p keeps the smallest
     prefix whose mass reaches p, including the token that crosses p. min_p sits before top_k/top_p as in
     vLLM v1 (an "argmax-invariant" logits processor there); min_p and top_k commute, and top_p then
     sees min_p's survivors. Finally one exact draw from what is left.
Logprobs (logprobs.py) describe the raw logits, before all of the above.

The draw is an exponential race: argmax(p_i / E_i), E_i ~ Exp(1) i.i.d., picks i with probability p_i,
and each row's E can come from that row's own generator. On CPU, 49k exponentials cost ~1 ms a row, and
sorting a row more, so the sampler works on candidates: top_k / few min_p survivors / a top_p nucleus
are found with a partial sort (topk) and noise is drawn for the kept candidates only. Unfiltered rows
draw in two exact stages: with probability M (the mass of their top _START_K tokens) among those, else
among the rest with full-vocabulary noise.
Reproducibility: a seeded row draws from its own generator a number of values, and assigns them to
tokens in an order (kept candidates by token id, or the whole vocabulary), that depend only on its own
logits and params, never on the other rows of the batch or its row index. The engine gives each seeded
row a fresh generator keyed by the request's seed and the row's output position (position_seeds.py).
Ties: logits exactly equal at the top_k boundary are cut to exactly k by topk's order (vLLM keeps them
all); tied logits inside the kept set are unaffected.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tokenmill.sample.logprobs import TokenLogprobs, fast_argmax, fast_topk, token_logprobs
from tokenmill.sample.penalties import LogitsProcessors
from tokenmill.sample.sampling_batch import SamplingBatch, plan_batch
from tokenmill.sample.sampling_params import SamplingParams

# Candidates first tried for a top_p nucleus, and the head of an unfiltered row: LLM distributions put
# most of their mass on far fewer tokens. A nucleus that does not fit retries with _CAP_K, then sorts.
_START_K = 64
# Above this, topk is not much cheaper than sorting; also the largest top_k handled as candidates (a
# larger one becomes a threshold on the full row).
_CAP_K = 1024
_NEG_INF = float("-inf")

Gens = list[torch.Generator | None]
Draw = Callable[[torch.Tensor, torch.Generator], torch.Tensor]  # fills its tensor in place, returns it


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [rows] int64
    logprobs: list[TokenLogprobs | None]  # per row; None where params.logprobs is None


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int], seed: int | None = None) -> None:
        self.vocab_size = vocab_size  # informational: the logits' own width is what gets sampled
        self.eos_token_ids = list(eos_token_ids)
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}
        self._processors = LogitsProcessors(self.eos_token_ids)
        # Reused [rows, vocab] work buffers (CPU): a fresh 12 MB tensor each step costs page faults
        # worth more than the arithmetic done in it.
        self._scratch: dict[str, torch.Tensor] = {}

    def _buffer(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """An uninitialised tensor shaped like `like` ([rows, vocab]), reused across steps on CPU."""
        rows = like.shape[0]
        if like.device.type != "cpu":  # the CUDA caching allocator already reuses memory
            return torch.empty((rows, like.shape[1]), dtype=like.dtype, device=like.device)
        need = rows * like.shape[1]
        buf = self._scratch.get(name)
        if buf is None or buf.numel() < need or buf.dtype != like.dtype or buf.device != like.device:
            buf = self._scratch[name] = torch.empty(need, dtype=like.dtype, device=like.device)
        return buf[:need].view(rows, like.shape[1])

    def engine_generator(self, device: torch.device) -> torch.Generator:
        """The generator of unseeded rows, one per device; seeded from `seed` (or the OS if None)."""
        g = self._generators.get(device)
        if g is None:
            g = torch.Generator(device=device)
            if self.seed is None:
                g.seed()
            else:
                g.manual_seed(self.seed)
            self._generators[device] = g
        return g

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        plan = plan_batch(batch)
        n_rows = logits.shape[0]
        dev = logits.device
        x = logits
        if plan.needs_processing:
            # The caller's logits stay raw: logprobs need them, and the caller may reuse them.
            x = self._buffer("processed", logits).copy_(logits)
            if plan.constrained:
                from tokenmill.sample.grammar import apply_grammar_masks  # xgrammar only when used

                apply_grammar_masks(x, batch.matchers or [])
            self._processors(x, batch, plan)
        if not plan.random:
            token_ids = fast_argmax(x)
        elif not plan.greedy:
            token_ids = self._sample_random(x, batch.params, batch.generators)
        else:
            token_ids = torch.empty(n_rows, dtype=torch.long, device=dev)
            greedy = torch.tensor(plan.greedy, device=dev)
            token_ids[greedy] = fast_argmax(x[greedy])
            rnd = torch.tensor(plan.random, device=dev)
            token_ids[rnd] = self._sample_random(
                x[rnd], [batch.params[i] for i in plan.random], [batch.generators[i] for i in plan.random]
            )
        logprobs: list[TokenLogprobs | None] = [None] * n_rows
        if plan.logprobs:
            rows = plan.logprobs
            top_ns = [batch.params[i].logprobs or 0 for i in rows]
            if len(rows) == n_rows:
                lps = token_logprobs(logits, token_ids, top_ns)
            else:
                idx = torch.tensor(rows, device=dev)
                lps = token_logprobs(logits[idx], token_ids[idx], top_ns)
            for i, lp in zip(rows, lps):
                logprobs[i] = lp
        return SamplerOutput(token_ids, logprobs)

    # ---- random rows ---------------------------------------------------------------------------
    def _sample_random(self, x: torch.Tensor, params: list[SamplingParams], gens: Gens) -> torch.Tensor:
        """x: processed logits of the random rows, read-only (it may be the caller's tensor)."""
        n, vocab = x.shape
        dev = x.device
        temps = torch.tensor([p.temperature for p in params], dtype=x.dtype, device=dev)
        ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
        ps = [p.top_p for p in params]
        # Temperature preserves order, so candidates are found on the unscaled logits and only they get
        # divided. min_p and a huge top_k become one per-row logit floor (min_p and top_k commute):
        # p_i < min_p * p_max  <=>  x_i / T < x_max / T + log(min_p)  <=>  x_i < x_max + T log(min_p).
        floor = None
        min_p_rows = [i for i, p in enumerate(params) if p.min_p > 0.0]
        if min_p_rows:
            log_min_p = [math.log(p.min_p) if p.min_p > 0.0 else _NEG_INF for p in params]
            floor = x.amax(dim=-1) + temps * torch.tensor(log_min_p, dtype=x.dtype, device=dev)
            wide = [i for i in min_p_rows if not 0 < ks[i] <= _CAP_K]
            if wide:
                idx = torch.tensor(wide, device=dev)
                sub = x if len(wide) == n else x[idx]
                survivors = (sub >= floor[idx].unsqueeze(1)).sum(dim=-1, dtype=torch.int32).tolist()
                for i, c in zip(wide, survivors):
                    if c <= _CAP_K:  # min_p often leaves a handful: then exactly they are the candidates
                        ks[i] = c
        for i, k in enumerate(ks):
            if k > _CAP_K:  # rare: a huge top_k is cheaper as a floor than as candidates
                floor = torch.full((n,), _NEG_INF, dtype=x.dtype, device=dev) if floor is None else floor
                floor[i] = torch.maximum(floor[i], x[i].kthvalue(vocab - k + 1).values)
                ks[i] = 0
        cand = [i for i in range(n) if ks[i] or ps[i] < 1.0]
        full = [i for i in range(n) if not (ks[i] or ps[i] < 1.0)]
        if len(full) == n:
            return self._sample_full(self._scaled(x, temps, floor, None), gens)
        token_ids = torch.empty(n, dtype=torch.long, device=dev)
        if full:
            idx = torch.tensor(full, device=dev)
            token_ids[idx] = self._sample_full(self._scaled(x, temps, floor, idx), [gens[i] for i in full])
        self._sample_candidates(x, temps, floor, cand, ks, ps, gens, token_ids)
        return token_ids

    def _sample_full(self, scaled: torch.Tensor, gens: Gens) -> torch.Tensor:
        """Rows without top_k / top_p (scaled logits, owned): an exact draw from softmax(scaled)."""
        m, vocab = scaled.shape
        dev = scaled.device
        if vocab < 4 * _START_K:  # small vocabulary: one race over all of it
            return self._race(scaled, gens)
        # Stage 1: with probability M, the mass of the top K tokens, the draw is among them (K noise
        # values); stage 2, probability 1 - M: among the others, with full-vocabulary noise. Exact.
        vals, ids = fast_topk(scaled, _START_K)
        finite = vals > _NEG_INF  # exact, unlike prob > 0: decides how many draws a seeded row makes
        head = vals.sub_(self._logsumexp(scaled)).exp_()
        uniform = torch.empty((m, 1), device=dev)
        self._fill_noise(uniform, gens, _uniform)
        in_head = (uniform[:, 0] < head.sum(dim=-1)).tolist()
        out = torch.empty(m, dtype=torch.long, device=dev)
        tail_rows = [j for j in range(m) if not in_head[j]]
        if tail_rows:
            idx = torch.tensor(tail_rows, device=dev)
            tail = scaled[idx].scatter_(1, ids[idx], _NEG_INF)
            # Rounding can leave M just under 1 for a row with nothing outside its head: draw in the head.
            has_tail = (tail.amax(dim=-1) > _NEG_INF).tolist()
            if not all(has_tail):
                for j, t in zip(tail_rows, has_tail):
                    in_head[j] = in_head[j] or not t
                tail = tail[torch.tensor(has_tail, device=dev)]
                tail_rows = [j for j, t in zip(tail_rows, has_tail) if t]
            if tail_rows:
                out[torch.tensor(tail_rows, device=dev)] = self._race(tail, [gens[j] for j in tail_rows])
        head_rows = [j for j in range(m) if in_head[j]]
        if head_rows:
            idx = torch.tensor(head_rows, device=dev)
            probs, ids, keep = head[idx], ids[idx], finite[idx]
            noise = self._candidate_noise(keep, ids, [gens[j] for j in head_rows])
            out[idx] = ids.gather(
                1, probs.masked_fill_(~keep, 0.0).div_(noise).argmax(dim=-1, keepdim=True)
            ).view(-1)
        return out

    def _race(self, scaled: torch.Tensor, gens: Gens) -> torch.Tensor:
        """Race over whole rows (scaled logits, owned; at least one finite per row)."""
        probs = scaled.sub_(scaled.amax(dim=-1, keepdim=True)).exp_()  # unnormalised suffices for argmax
        noise = torch.empty_like(probs)
        self._fill_noise(noise, gens, _exp)
        # exponential_ may return exactly 0; p / 0 would give inf, or NaN (which argmax picks) for p = 0.
        return probs.div_(noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)

    def _sample_candidates(
        self,
        x: torch.Tensor,
        temps: torch.Tensor,
        floor: torch.Tensor | None,
        rows: list[int],
        ks: list[int],
        ps: list[float],
        gens: Gens,
        out: torch.Tensor,
    ) -> None:
        """top_k / top_p / few-survivor min_p rows: filter and race among each row's largest logits."""
        n, vocab = x.shape
        dev = x.device
        # top_p without top_k renormalises over the whole (floored) row.
        lse_full = torch.full((n,), _NEG_INF, dtype=x.dtype, device=dev)
        no_k = [i for i in rows if not ks[i]]
        if no_k:
            idx = torch.tensor(no_k, device=dev)
            lse_full[idx] = self._logsumexp(self._scaled(x, temps, floor, idx))[:, 0]
        pending = rows
        k = min(vocab, max(ks[i] or _START_K for i in rows))
        while pending:
            idx = torch.tensor(pending, device=dev)
            sub = x if len(pending) == n else x[idx]
            vals, ids = sub.sort(dim=-1, descending=True) if k >= vocab else fast_topk(sub, k)
            k_row = torch.tensor([ks[i] or k for i in pending], device=dev)
            drop = torch.arange(k, device=dev) >= k_row.unsqueeze(1)
            if floor is not None:
                drop |= vals < floor[idx].unsqueeze(1)
            vals = vals.div_(temps[idx].unsqueeze(1)).masked_fill_(drop, _NEG_INF)
            finite = vals > _NEG_INF  # exact, unlike prob > 0: decides how many draws a seeded row makes
            has_k = torch.tensor([ks[i] > 0 for i in pending], device=dev)
            lse = torch.where(has_k, vals.logsumexp(dim=-1), lse_full[idx])
            probs = vals.sub_(lse.unsqueeze(1)).exp_()
            cum = probs.cumsum(dim=-1)
            p = torch.tensor([ps[i] for i in pending], dtype=probs.dtype, device=dev).unsqueeze(1)
            # Keep a token while the mass strictly above it is < p: the token that crosses p stays.
            keep = (((cum - probs) < p) | (p >= 1.0)) & finite
            # The nucleus fits in these k candidates iff the one after them would be dropped.
            covered = (has_k | (cum[:, -1] >= p[:, 0])) if k < vocab else torch.ones_like(has_k)
            done = None if bool(covered.all()) else covered.nonzero().view(-1)
            done_rows = pending if done is None else [pending[j] for j in done.tolist()]
            if done is not None:
                probs, ids, keep, idx = probs[done], ids[done], keep[done], idx[done]
            if done_rows:
                noise = self._candidate_noise(keep, ids, [gens[i] for i in done_rows])
                scores = probs.masked_fill_(~keep, 0.0).div_(noise)
                out[idx] = ids.gather(1, scores.argmax(dim=-1, keepdim=True)).view(-1)
                finished = set(done_rows)
                pending = [i for i in pending if i not in finished]
            k = min(vocab, _CAP_K) if k < _CAP_K else vocab

    def _candidate_noise(self, keep: torch.Tensor, ids: torch.Tensor, gens: Gens) -> torch.Tensor:
        n, k = keep.shape
        noise = torch.ones((n, k), device=keep.device)
        self._fill_noise(noise, gens, _exp, seeded=False)
        seeded = [j for j, g in enumerate(gens) if g is not None]
        if seeded:
            # One draw per kept token, in token-id order: independent of k, of where ties landed in
            # topk's output and of every other row.
            sel = torch.tensor(seeded, device=keep.device)
            kept = keep[sel]
            order = ids[sel].masked_fill(~kept, torch.iinfo(ids.dtype).max).argsort(dim=-1)
            draws = torch.ones((len(seeded), k), device=keep.device)
            for row, (j, count) in enumerate(zip(seeded, kept.sum(dim=-1).tolist())):
                _on_generator(draws[row, :count], gens[j], _exp)
            noise[sel] = torch.ones_like(draws).scatter_(1, order, draws)
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)

    def _scaled(
        self, x: torch.Tensor, temps: torch.Tensor, floor: torch.Tensor | None, idx: torch.Tensor | None
    ) -> torch.Tensor:
        """Rows of x (all, or idx) divided by temperature, -inf below their floor; in a work buffer."""
        sub = x if idx is None else x[idx]
        out = torch.div(
            sub, (temps if idx is None else temps[idx]).unsqueeze(1), out=self._buffer("scaled", sub)
        )
        if floor is not None:
            out.masked_fill_(sub < (floor if idx is None else floor[idx]).unsqueeze(1), _NEG_INF)
        return out

    def _logsumexp(self, t: torch.Tensor) -> torch.Tensor:
        """[rows, 1]; torch.logsumexp, minus its [rows, vocab] temporaries."""
        top = t.amax(dim=-1, keepdim=True)
        safe = top.masked_fill(top == _NEG_INF, 0.0)  # an all -inf row: -inf, not NaN
        exp = torch.sub(t, safe, out=self._buffer("exp", t)).exp_()
        return exp.sum(dim=-1, keepdim=True).log_().add_(safe)

    def _fill_noise(self, out: torch.Tensor, gens: Gens, draw: Draw, seeded: bool = True) -> None:
        """Row j of `out` from draw(_, gens[j]); the rows without a generator share one draw from the
        engine generator."""
        unseeded = [j for j, g in enumerate(gens) if g is None]
        if unseeded:
            engine = self.engine_generator(out.device)
            if len(unseeded) == len(gens):
                draw(out, engine)
            else:
                idx = torch.tensor(unseeded, device=out.device)
                out[idx] = draw(torch.empty((len(unseeded), out.shape[1]), device=out.device), engine)
        if seeded:
            for j, g in enumerate(gens):
                if g is not None:
                    _on_generator(out[j], g, draw)


def _exp(t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    return t.exponential_(generator=g)


def _uniform(t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    return t.uniform_(generator=g)


def _on_generator(out: torch.Tensor, gen: torch.Generator, draw: Draw) -> None:
    """Fill `out` with draw(_, gen) made on the generator's own device (a request's CPU generator may
    serve a CUDA batch)."""
    if out.numel() == 0:
        return
    if gen.device == out.device:
        draw(out, gen)
    else:
        out.copy_(draw(torch.empty(out.shape, device=gen.device), gen))
