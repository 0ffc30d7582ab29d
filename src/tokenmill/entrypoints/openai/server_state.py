"""What the HTTP routes serve one model with: its TokenizerManager, metrics and the serving objects
built over them. One per server, or one per loaded model behind the model router (model_pool.py)."""

from __future__ import annotations

from tokenmill.entrypoints.openai.metrics import ServerMetrics
from tokenmill.entrypoints.openai.serving_chat import ChatServing
from tokenmill.entrypoints.openai.serving_completion import CompletionServing
from tokenmill.entrypoints.openai.serving_embedding import EmbeddingServing
from tokenmill.entrypoints.openai.serving_tokenize import TokenizeServing
from tokenmill.frontend.dp_router import DataParallelRouter
from tokenmill.frontend.reasoning_parser import ReasoningParser
from tokenmill.frontend.tokenizer_manager import TokenizerManager
from tokenmill.frontend.tool_parsers import ToolParser


class ServerState:
    """What the routes need; filled in by the lifespan (or by a test, with a manager of its own)."""

    manager: TokenizerManager
    metrics: ServerMetrics
    chat: ChatServing
    completion: CompletionServing
    tokens: TokenizeServing
    replicas: DataParallelRouter | None = None  # with --data-parallel-size > 1

    def attach(self, manager: TokenizerManager, metrics: ServerMetrics,
               reasoning_parser: ReasoningParser | None = None, tool_parser: ToolParser | None = None) -> None:
        self.manager, self.metrics = manager, metrics
        self.chat = ChatServing(manager, reasoning_parser, tool_parser)
        self.completion = CompletionServing(manager)
        self.tokens = TokenizeServing(manager)
        self.embeddings = EmbeddingServing(manager, metrics)
