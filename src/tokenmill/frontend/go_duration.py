"""Go's duration strings ("1h30m", "1.5h", "300ms", "-1m"), as Go's time.ParseDuration reads them.

Why: Ollama reads a string `keep_alive` with time.ParseDuration, and its clients send what Go
accepts ("1h30m", "2h45m30s"); a parser of one number and one unit refused those with a 400.
"""

from __future__ import annotations

import re

_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
# A number (digits on at least one side of an optional point) and its unit; the longer units first.
_PART = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|µs|μs|ms|s|m|h)")


def parse_go_duration(text: str) -> float:
    """Seconds. Raises ValueError on anything time.ParseDuration refuses (except that it has no
    upper bound here: the caller decides what a very long duration means)."""
    body = text[1:] if text[:1] in ("-", "+") else text
    sign = -1.0 if text[:1] == "-" else 1.0
    if body == "0":  # the one unitless number Go accepts
        return 0.0
    seconds, at = 0.0, 0
    for part in _PART.finditer(body):
        if part.start() != at:
            break
        seconds += float(part.group(1)) * _UNITS[part.group(2)]
        at = part.end()
    if not body or at != len(body):
        raise ValueError(f"not a Go duration: {text!r}")
    return sign * seconds
