"""Grammar-constrained decoding: compile a constraint once, then per step a token bitmask per row.

The engine talks to one small interface, so another backend (llguidance) can sit next to xgrammar:
  backend.parse(spec)           -> cheap and tokenizer-free; raises InvalidRequest for a bad spec
  backend.compile(spec)         -> a compiled grammar (tokenizer-specific; slow for big schemas)
  backend.matcher(compiled)     -> per request: fill_bitmask / accept_token / rollback(k) / is_terminated
  backend.apply(logits, matchers, rows) -> -inf on the tokens each row's grammar forbids, in place
GrammarManager adds the compile cache (keyed by the spec, so one schema is compiled once) and a small
thread pool: add_request only parses (so a bad schema is a 400 before the request is queued) and
compilation overlaps the prefill forward pass; the engine waits for it only when it first samples.

xgrammar runs on CPU; it is installed with --no-deps (see README) because it declares triton, a GPU
compiler we never use, as a Linux dependency. It is imported lazily: free-text serving needs none of it.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import torch

from tokenmill.errors import InvalidRequest
from tokenmill.sample.sampling_params import StructuredOutputParams

logger = logging.getLogger(__name__)

# Compiled grammars kept; a JSON-schema grammar is tens of KB to a few MB (its token mask cache).
CACHE_SIZE = 256
# Compilation is mostly C++ that releases the GIL; two workers keep it off the step without
# starving the forward pass of cores.
COMPILE_WORKERS = 2


class GrammarMatcher(Protocol):
    """One request's position in its grammar."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None: ...
    def accept_token(self, token_id: int) -> bool: ...
    def rollback(self, num_tokens: int) -> None: ...
    def is_terminated(self) -> bool: ...


class GrammarBackend(Protocol):
    @staticmethod
    def parse_spec(spec: StructuredOutputParams) -> Any: ...
    def parse(self, spec: StructuredOutputParams) -> Any: ...
    def compile(self, spec: StructuredOutputParams) -> Any: ...
    def matcher(self, compiled: Any) -> GrammarMatcher: ...
    def apply(self, logits: torch.Tensor, matchers: Sequence[GrammarMatcher], rows: list[int]) -> None: ...


def _choice_ebnf(choices: list[str]) -> str:
    # EBNF string literals take JSON-style escapes; json.dumps gives exactly that for any text.
    import json

    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class XGrammarMatcher:
    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        return bool(self._m.accept_token(token_id))

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())


class XGrammarBackend:
    """xgrammar on CPU. vocab_size is the model's logits width (the embedding may be padded past the
    tokenizer's vocabulary; xgrammar masks the padding)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))
        # Our own cache (GrammarManager) sits in front; xgrammar's would hold a second copy.
        self._compiler = xgr.GrammarCompiler(info, max_threads=COMPILE_WORKERS, cache_enabled=False)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # grown on demand, reused per step

    def parse(self, spec: StructuredOutputParams) -> Any:
        return self.parse_spec(spec)

    @staticmethod
    def parse_spec(spec: StructuredOutputParams) -> Any:
        """Tokenizer-free, so it runs before the backend (and its tokenizer) has loaded."""
        import xgrammar as xgr

        kind = spec.kind
        try:
            if kind in ("json_schema", "json_object"):
                # Compact JSON: with free whitespace a small model pads with spaces and newlines (or
                # loops on them) and runs out of max_tokens before the closing brace.
                schema = spec.json_schema if kind == "json_schema" else {"type": "object"}
                return xgr.Grammar.from_json_schema(schema, any_whitespace=False, separators=(",", ":"))
            if kind == "regex":
                return xgr.Grammar.from_regex(spec.regex)
            if kind == "grammar":
                return xgr.Grammar.from_ebnf(spec.grammar)
            return xgr.Grammar.from_ebnf(_choice_ebnf(list(spec.choice or [])))
        except (RuntimeError, ValueError, TypeError) as exc:
            # xgrammar's messages start with "[time] /path/file.cc:line: "; the client needs the rest.
            why = str(exc).strip().split(": ", 1)[-1] if str(exc).startswith("[") else str(exc).strip()
            raise InvalidRequest(f"{spec.param}: invalid {kind}: {why}", param=spec.param) from None

    def compile(self, spec: StructuredOutputParams) -> Any:
        return self._compiler.compile_grammar(self.parse(spec))

    def matcher(self, compiled: Any) -> XGrammarMatcher:
        # max_rollback_tokens=-1: unbounded history, so speculative decoding can roll back any draft.
        return XGrammarMatcher(self._xgr.GrammarMatcher(compiled, max_rollback_tokens=-1))

    def apply(self, logits: torch.Tensor, matchers: Sequence[GrammarMatcher], rows: list[int]) -> None:
        """logits: [n, vocab] fp32 CPU, modified in place on `rows`; matchers[j] belongs to rows[j]."""
        n = logits.shape[0]
        if self._bitmask.shape[0] < n:
            self._bitmask = self._xgr.allocate_token_bitmask(n, self.vocab_size)
        bitmask = self._bitmask[:n]
        for row, m in zip(rows, matchers):
            m.fill_bitmask(bitmask, row)
        if logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits width {logits.shape[1]} < grammar vocabulary {self.vocab_size}")
        self._xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)


def apply_grammar_masks(logits: torch.Tensor, matchers: Sequence[GrammarMatcher | None]) -> list[int]:
    """The sampler's entry point: mask every constrained row (matchers[i] not None); returns those rows."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if rows:
        first = matchers[rows[0]]
        backend = getattr(first, "backend", None)
        if backend is None:
            raise TypeError("a grammar matcher must come from GrammarManager.matcher (it carries its backend)")
        backend.apply(logits, [matchers[i] for i in rows], rows)
    return rows


class _BoundMatcher:
    """A matcher plus the backend that masks with it, so the sampler needs no engine state."""

    def __init__(self, inner: GrammarMatcher, backend: GrammarBackend) -> None:
        self.inner = inner
        self.backend = backend

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.inner.fill_bitmask(bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        return self.inner.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        self.inner.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()


class GrammarManager:
    """Owns one backend (built lazily, off the step), the compile cache and the compile pool."""

    def __init__(self, make_backend: Any, parse: Any = XGrammarBackend.parse_spec) -> None:
        self._parse = parse
        self._pool = ThreadPoolExecutor(max_workers=COMPILE_WORKERS, thread_name_prefix="grammar")
        # Building the backend loads a transformers tokenizer (seconds): start it in the pool too.
        self._backend: Future[GrammarBackend] = self._pool.submit(make_backend)
        self._cache: OrderedDict[tuple[str, str], Future[Any]] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def backend(self) -> GrammarBackend:
        return self._backend.result()

    def submit(self, spec: StructuredOutputParams) -> Future[Any]:
        """Validates now (InvalidRequest on a bad spec) and returns the compiled grammar's future."""
        key = spec.cache_key()
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                return fut
        self._parse(spec)  # cheap, tokenizer-free: the error reaches the client before queueing
        fut = self._pool.submit(lambda: self.backend.compile(spec))
        with self._lock:
            self._cache[key] = fut
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        fut.add_done_callback(lambda f: self._forget_failed(key, f))
        return fut

    def _forget_failed(self, key: tuple[str, str], fut: Future[Any]) -> None:
        # A failed compile (an xgrammar fault past parsing) must not poison the spec for later requests.
        if not fut.cancelled() and fut.exception() is not None:
            with self._lock:
                if self._cache.get(key) is fut:
                    del self._cache[key]

    def matcher(self, compiled: Future[Any]) -> GrammarMatcher:
        backend = self.backend
        return _BoundMatcher(backend.matcher(compiled.result()), backend)

    def cache_size(self) -> int:
        return len(self._cache)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@functools.lru_cache(maxsize=4)
def xgrammar_backend(backend: Any, vocab_size: int, stop_token_ids: tuple[int, ...]) -> XGrammarBackend:
    """One backend per model (TokenizerInfo construction walks the whole vocabulary). `backend` is the
    model's `tokenizers.Tokenizer`, the very object the frontend encodes with (model/tokenizer_files.py
    loads it once per path): same ids, no second load."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=backend)
    logger.info("xgrammar backend (vocab %d)", vocab_size)
    return XGrammarBackend(hf, vocab_size, stop_token_ids)
