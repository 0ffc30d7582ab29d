"""Which tool-call parser goes with the model's chat template.

The template teaches the model how to write a call (it renders `tools` and past calls); the parser
must read that same markup back, so the two come as a pair (seed 001: a mismatched pair looks like a
model that never calls tools). Without `--tool-call-parser`, the parser is read from the template when
its markup is recognisable; with it, a parser that contradicts a recognised template is logged as a
warning (the flag still wins: the user may know better, e.g. a fine-tune writing another format).
A template showing no known markup (SmolLM2's, which does not render tools at all) gets no parser:
the model's text stays content, and only tool_choice "required" or a named function (generated under
the tools' grammar, no parser needed) return calls.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tokenmill.frontend.tokenizer import Tokenizer
from tokenmill.frontend.tool_parsers import ToolParser, get_tool_parser

logger = logging.getLogger(__name__)


def detect_tool_format(template: str | None) -> str | None:
    """The parser name whose markup `template` writes, or None if none is recognised.
    Order matters: GLM and Qwen3-Coder templates also contain `<tool_call>`."""
    if not template:
        return None
    if "<arg_key>" in template:
        return "glm45"
    if "<function=" in template:  # Qwen3-Coder's XML calls inside <tool_call>
        return "qwen3_coder"
    if "func_name1(" in template or "[func_name(" in template:
        return "pythonic"  # Llama 3.2's pythonic and Llama 4's templates show `[func_name1(param=value)]`
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or ("ipython" in template and '"parameters"' in template):
        return "llama3_json"  # Llama 3.x: JSON {"name", "parameters"} calls, results in ipython turns
    return None


@dataclass(frozen=True)
class ToolParserChoice:
    parser: ToolParser | None
    detected: str | None  # what the template writes
    message: str  # why, for the start-up log
    mismatch: bool = False  # the flag names another parser than the template's


def choose_tool_parser(flag: str | None, template: str | None) -> ToolParserChoice:
    detected = detect_tool_format(template)
    if flag is not None:
        parser = get_tool_parser(flag)
        if detected is None:
            return ToolParserChoice(parser, None, f"tool calls: parser {flag} (--tool-call-parser; the chat "
                                                  "template shows no tool-call markup this server recognises)")
        if detected != flag:
            return ToolParserChoice(parser, detected, (
                f"tool calls: --tool-call-parser {flag}, but the chat template writes {detected}-style calls; "
                f"the model will likely write calls {flag} cannot read (use --tool-call-parser {detected}, "
                "or a template that matches)"), mismatch=True)
        return ToolParserChoice(parser, detected, f"tool calls: parser {flag} (--tool-call-parser, matches "
                                                  "the chat template)")
    if detected is not None:
        return ToolParserChoice(get_tool_parser(detected), detected,
                                f"tool calls: parser {detected} (read from the chat template; "
                                "--tool-call-parser overrides)")
    return ToolParserChoice(None, None, "tool calls: not parsed (the chat template shows no recognised "
                                        "tool-call markup and no --tool-call-parser was given); tool_choice "
                                        "'required' or a named function still returns calls")


def markers_are_special(parser: ToolParser, tokenizer: Tokenizer) -> bool:
    """True when `parser`'s start marker is one special token of `tokenizer` (Hermes 2/3, Mistral):
    decoding with skip_special_tokens (the default) would drop it and no call could be read, so chat
    requests that may call tools decode with special tokens kept, as vLLM's hermes and mistral parsers
    make them. EOS stays hidden either way (output_state shows no stop token's text)."""
    ids = tokenizer.encode(parser.start, add_special_tokens=False)
    return len(ids) == 1 and ids[0] in tokenizer.all_special_ids


def log_choice(choice: ToolParserChoice) -> None:
    logger.log(logging.WARNING if choice.mismatch else logging.INFO, "%s", choice.message)
