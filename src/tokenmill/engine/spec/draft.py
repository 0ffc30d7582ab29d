"""The draft-model proposer: a smaller (or cheaper-precision) model guesses the target's next tokens.

The n-gram proposer only helps where output repeats its input; a draft model guesses anywhere the
two models agree. The draft runs greedily (verification treats each proposal as the draft's one-hot
choice), in its own KV page pool, with its own state per request: the pages it holds and the token
ids whose K/V those pages contain. Between two calls the target accepts some drafts and rejects the
rest, so each call first keeps the longest prefix of the draft cache that still matches the request's
tokens, recomputes the rest in one flat batch with every other request's catch-up, and then decodes
the further drafts of all requests together, one batched step per draft position.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tokenmill.config import EngineConfig
from tokenmill.engine.request import Request
from tokenmill.errors import InvalidRequest
from tokenmill.kvcache.page_pool import PagePool
from tokenmill.model.builder import build_model
from tokenmill.model.default_model import default_model_path
from tokenmill.model.runner import ModelRunner, SeqChunk
from tokenmill.sample.logprobs import fast_argmax

logger = logging.getLogger(__name__)


@dataclass
class DraftState:
    """What the draft cache holds for one request: position p of `tokens` has its K/V in the slot
    `pages[p // page_size] * page_size + p % page_size`."""

    pages: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class DraftModelProposer:
    def __init__(self, runner: ModelRunner, pool: PagePool, max_model_len: int) -> None:
        self.runner = runner
        self.pool = pool
        self.max_model_len = max_model_len  # the draft's own context: positions past it have no RoPE
        self._states: dict[str, DraftState] = {}

    # ---- the Proposer protocol ------------------------------------------------------------------
    def propose(self, requests: Sequence[Request], max_tokens: Sequence[int]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in requests]
        # Trim every request's cache to its valid prefix before anyone allocates, so pages a
        # rejected draft held can serve another request in this same call.
        for r in requests:
            self._trim(r)
        wanted = [self._fit(r, k) for r, k in zip(requests, max_tokens)]
        active = [i for i, k in enumerate(wanted) if k > 0 and self._reserve(requests[i], k)]
        if not active:
            return out
        first = self._catch_up([requests[i] for i in active])
        for i, token in zip(active, first):
            out[i].append(token)
        for step in range(1, max(wanted[i] for i in active)):
            rows = [i for i in active if wanted[i] > step]
            nxt = self._decode([requests[i].request_id for i in rows], [out[i][-1] for i in rows])
            for i, token in zip(rows, nxt):
                out[i].append(token)
        return out

    def release(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is not None:
            self.pool.free(state.pages)

    def check_idle(self) -> None:
        self.pool.check_integrity({rid: s.pages for rid, s in self._states.items()})
        if self._states:
            raise AssertionError(f"draft proposer idle but holds state for {sorted(self._states)}")
        if self.pool.num_free != self.pool.num_pages:
            raise AssertionError(f"draft proposer idle but {self.pool.num_pages - self.pool.num_free} pages held")

    # ---- one call, in steps -------------------------------------------------------------------
    def _fit(self, request: Request, k: int) -> int:
        """k capped so that every position fed (up to num_tokens + k - 2) lies in the draft's context."""
        return max(0, min(k, self.max_model_len - request.num_tokens + 1))

    def _trim(self, request: Request) -> None:
        """Keeps the draft K/V that still matches the request's tokens and frees the pages beyond it."""
        state = self._states.get(request.request_id)
        if state is None:
            return
        ids = request.all_token_ids
        # The last known token always runs: its logits give the first draft.
        keep = min(common_prefix_len(state.tokens, ids), len(ids) - 1)
        del state.tokens[keep:]
        keep_pages = self.pool.pages_for(keep)
        if len(state.pages) > keep_pages:
            self.pool.free(state.pages[keep_pages:])
            del state.pages[keep_pages:]

    def _reserve(self, request: Request, k: int) -> bool:
        """Pages for the catch-up chunk and the k - 1 drafts fed after it, all taken now so that a dry
        pool fails before anything runs. On failure the request drops its draft state and gets none."""
        state = self._states.setdefault(request.request_id, DraftState())
        need = self.pool.pages_for(request.num_tokens + k - 1) - len(state.pages)
        if need > self.pool.num_free:
            self.release(request.request_id)
            return False
        state.pages.extend(self.pool.allocate(max(0, need)))
        return True

    def _catch_up(self, requests: list[Request]) -> list[int]:
        """One batch computing every request's tokens missing from the draft cache (on first sight,
        its whole prompt); the argmax of each last row is that request's first draft."""
        states = [self._states[r.request_id] for r in requests]
        chunks = [SeqChunk(r.all_token_ids[len(s.tokens):], len(s.tokens), s.pages, sample=True)
                  for r, s in zip(requests, states)]
        drafts = self._argmax(self.runner.execute(chunks))
        # Recorded once the forward has written the K/V, so a failed forward claims nothing.
        for s, c in zip(states, chunks):
            s.tokens.extend(c.token_ids)
        return drafts

    def _decode(self, request_ids: list[str], tokens: list[int]) -> list[int]:
        """One batched decode step: each request's latest draft in, its next draft out."""
        states = [self._states[rid] for rid in request_ids]
        chunks = [SeqChunk([t], len(s.tokens), s.pages, sample=True) for s, t in zip(states, tokens)]
        drafts = self._argmax(self.runner.execute(chunks))
        for s, t in zip(states, tokens):
            s.tokens.append(t)
        return drafts

    @staticmethod
    def _argmax(logits: torch.Tensor) -> list[int]:
        # The sampler's own greedy choice (first maximum on ties): an identical draft then proposes
        # exactly what the target picks.
        return fast_argmax(logits).tolist()


def build_draft_proposer(config: EngineConfig, target_vocab_size: int) -> DraftModelProposer:
    spec = config.speculative
    if spec is None:
        raise ValueError("build_draft_proposer needs config.speculative")
    path = spec.model or config.model or default_model_path()
    if path == (config.model or default_model_path()) and (spec.draft_precision, spec.draft_quantization) == (
        config.precision, config.quantization
    ):
        logger.warning("the draft is the target itself at the same precision: it will accept everything and save nothing")
    # The target's pool size: a draft never holds more positions than its request plus k. The tensors
    # are torch.empty, so only pages ever written become resident.
    built = build_model(path, spec.draft_precision, spec.draft_quantization, config.bf16_min_rows,
                        config.max_model_len, config.num_pages, config.page_size,
                        hybrid_kv=False,  # it runs its own page lists (one KV group)
                        prompt_gemm=config.prompt_gemm)
    mc = built.config
    if mc.vocab_size != target_vocab_size:
        raise InvalidRequest(
            f"the draft model's vocabulary ({mc.vocab_size} tokens, {built.source}) differs from the "
            f"target's ({target_vocab_size}): drafts must be token ids of the target",
            param="speculative_model",
        )
    logger.info(
        "draft model %s (%s, %d layers); precision %s, quantization %s; weights %.1f MB",
        built.source, mc.architecture, mc.num_layers, spec.draft_precision, spec.draft_quantization,
        built.runner.model.weight_bytes() / 1e6,
    )
    return DraftModelProposer(built.runner, PagePool(config.num_pages, config.page_size), built.max_model_len)
