"""POST /v1/embeddings: strings or token-id lists (one or a batch) -> one vector each.

Each input is one embedding request of the engine (engine/pooling.py: prefill only, in the same
batches as generation, no KV kept): the pooled final hidden state, L2-normalised, as float lists
or, with `encoding_format: "base64"`, float32 little-endian bytes in base64 (what the openai SDK
asks for by default and decodes itself). `embed_inputs` is shared with Ollama's /api/embed.
"""

from __future__ import annotations

import base64
from array import array
from typing import Annotated, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from tokenmill.entrypoints.openai.metrics import ServerMetrics
from tokenmill.entrypoints.openai.request_log import record_of
from tokenmill.entrypoints.openai.serving_common import (
    ClientDisconnected,
    check_model,
    disconnected_response,
    new_id,
    parse_body,
    unless_disconnected,
)
from tokenmill.errors import InvalidRequest
from tokenmill.frontend.tokenize_pool import check_length_bound, run_tokenizer
from tokenmill.frontend.tokenizer import Tokenizer
from tokenmill.frontend.tokenizer_manager import TokenizerManager
from tokenmill.pooling_params import PoolingParams

TokenId = Annotated[int, Field(ge=0, le=2**63 - 1)]
MAX_INPUTS = 2048  # OpenAI's own limit on inputs per request

Inputs = str | list[str] | list[TokenId] | list[list[TokenId]]


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    input: Inputs
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


def _tokenize(tokenizer: Tokenizer, inputs: Inputs, max_model_len: int, param: str,
              truncate: bool = False) -> list[list[int]]:
    """Token ids per input. Runs in a thread or a tokenizer worker (frontend/tokenize_pool.py).
    truncate: each input's first max_model_len tokens, as Ollama's `truncate` (its default) asks."""
    if isinstance(inputs, str):
        inputs = [inputs]
    if not inputs:
        raise InvalidRequest(f"{param} is empty", param=param)
    if all(isinstance(t, int) for t in inputs):
        return [list(inputs)]  # type: ignore[arg-type]
    if len(inputs) > MAX_INPUTS:
        raise InvalidRequest(f"{param} has {len(inputs)} items; at most {MAX_INPUTS} per request", param=param)
    out = []
    for item in inputs:
        if isinstance(item, str):
            if not item:
                raise InvalidRequest(f"{param} holds an empty string", param=param)
            if not truncate:
                check_length_bound(tokenizer, item, max_model_len, param)
            out.append(tokenizer.encode(item))
        else:
            out.append(list(item))
    return [ids[:max_model_len] for ids in out] if truncate else out


async def embed_inputs(manager: TokenizerManager, metrics: ServerMetrics, inputs: Inputs, request_id: str,
                       param: str = "input", truncate: bool = False) -> tuple[list[bytes], int]:
    """The vectors (float32 bytes) of `inputs` and their token count, through the engine."""
    assert manager.limits is not None
    ids = await run_tokenizer(manager, _tokenize, inputs, manager.limits.max_model_len, param, truncate)
    vectors = await manager.embed(request_id, ids, PoolingParams(), param)
    tokens = sum(len(i) for i in ids)
    metrics.observe_embedding(tokens)
    return vectors, tokens


def as_floats(vector: bytes) -> list[float]:
    return array("f", vector).tolist()  # the scheduler sends little-endian, as every CPU we run on is


class EmbeddingServing:
    def __init__(self, manager: TokenizerManager, metrics: ServerMetrics) -> None:
        self.manager = manager
        self.metrics = metrics

    async def create(self, raw: Request) -> Response:
        req = await parse_body(raw, EmbeddingRequest)
        self.manager.check_ready()
        assert self.manager.limits is not None
        model = self.manager.limits.model_name
        check_model(req.model, model)
        if req.dimensions is not None:
            raise InvalidRequest("dimensions is not supported: this model's embeddings have one size (leave it out)",
                                 param="dimensions")
        request_id = new_id("embd")
        try:
            vectors, tokens = await unless_disconnected(
                raw, embed_inputs(self.manager, self.metrics, req.input, request_id))
        except ClientDisconnected:
            return disconnected_response()
        record = record_of(raw)
        record.request_id, record.prompt_tokens = request_id, tokens
        encode = (lambda v: base64.b64encode(v).decode("ascii")) if req.encoding_format == "base64" else as_floats
        return JSONResponse({
            "object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": encode(v)} for i, v in enumerate(vectors)],
            "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        })
