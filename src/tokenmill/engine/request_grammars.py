"""Structured output's part of the engine core: each constrained request's grammar, from the
request's admission (parsed there, compiled in the background) to the matcher the sampler masks its
rows with, and dropped when the request ends.

The grammar manager (sample/grammar.py, on xgrammar) is loaded on the first constrained request, so
an engine that never sees one never imports xgrammar.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

from tokenmill.engine.request import Request
from tokenmill.errors import InvalidRequest
from tokenmill.sample.sampling_params import StructuredOutputParams

logger = logging.getLogger(__name__)

FAILED = False  # a row whose grammar failed to compile: its request is to be aborted


class RequestGrammars:
    """Compiled grammars still on their way and each constrained request's matcher, by request id."""

    def __init__(self, model_path: Callable[[], str], vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self._model_path = model_path  # the tokenizer's files, read when the manager is first needed
        self._vocab_size = vocab_size
        self._stops = tuple(sorted(eos_token_ids))
        self._manager: Any = None
        self.pending: dict[str, Future[Any]] = {}
        self.matchers: dict[str, Any] = {}

    def manager(self) -> Any:
        if self._manager is None:
            from tokenmill.model.tokenizer_files import load_tokenizer_files
            from tokenmill.sample.grammar import GrammarManager, xgrammar_backend

            try:
                import xgrammar  # noqa: F401
            except ImportError:
                raise InvalidRequest(
                    "structured output needs xgrammar: pip install --no-deps xgrammar==0.2.8 apache-tvm-ffi",
                    param="response_format",
                ) from None
            path, vocab, stops = self._model_path(), self._vocab_size, self._stops
            self._manager = GrammarManager(lambda: xgrammar_backend(load_tokenizer_files(path).backend, vocab, stops))
        return self._manager

    def submit(self, request_id: str, spec: StructuredOutputParams) -> None:
        """Parses the spec now (a bad schema raises here, before the request is queued); compiles it in
        the background."""
        self.pending[request_id] = self.manager().submit(spec)

    def active(self) -> bool:
        return bool(self.matchers or self.pending)

    def rows(self, sampling: list[Request]) -> list[Any]:
        """Per sampled request: its matcher (created when it first samples, its grammar compiled
        meanwhile), None for a free request, or FAILED where xgrammar could not compile the grammar
        (parsing passed, so it is xgrammar's own failure: the caller aborts that request, not the step)."""
        out: list[Any] = []
        for r in sampling:
            rid = r.request_id
            if r.params.structured_output is None:
                out.append(None)
            elif rid in self.matchers:
                out.append(self.matchers[rid])
            else:
                try:
                    out.append(self.matchers.setdefault(rid, self._manager.matcher(self.pending.pop(rid))))
                except Exception:
                    logger.exception("request %s: grammar compilation failed; aborting it", rid)
                    self.drop(rid)
                    out.append(FAILED)
        return out

    def drop(self, request_id: str) -> None:
        self.pending.pop(request_id, None)
        self.matchers.pop(request_id, None)
