"""argparse types the benchmarks share; torch-free, for the benchmarks that only drive servers."""

from __future__ import annotations

import argparse


def at_least(minimum: int):
    """An argparse type: an integer of at least `minimum`, else a clear usage error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse
