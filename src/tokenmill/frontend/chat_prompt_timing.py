"""A chat's prompt ids with the time its template took, for the request's timeline.

Rendering a template and encoding its text are separate stages of a request (a long conversation with
tools can spend more in Jinja than in the tokenizer), so the chat path renders, checks the length
bound and encodes here, stamping each step. It may run in a thread of the API process
or in a --tokenizer-workers process, so it reports what it measured with its process id
(request_timelines.timed_prompt) and the API process decides which stamps it can use.
"""

from __future__ import annotations

import time
from typing import Any

from tokenmill.frontend.request_timelines import timed_prompt
from tokenmill.frontend.tokenize_pool import check_length_bound
from tokenmill.frontend.tokenizer import Tokenizer


def timed_chat_prompt_ids(tokenizer: Tokenizer, messages: Any, max_model_len: int,
                          **template_args: Any) -> tuple[list[int], dict[str, Any]]:
    """(prompt ids, timed_prompt(...)); the length bound is checked between rendering and encoding."""
    start = time.monotonic()
    text = tokenizer.render_chat(messages, **template_args)
    rendered = time.monotonic()
    check_length_bound(tokenizer, text, max_model_len, "messages")
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids, timed_prompt(rendered, rendered - start, time.monotonic() - rendered)
