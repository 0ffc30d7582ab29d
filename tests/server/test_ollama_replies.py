"""How Ollama's listings describe a model (entrypoints/ollama/replies.py)."""

from __future__ import annotations

from tokenmill.entrypoints.ollama.replies import human_number


def test_parameter_sizes_are_written_as_ollama_writes_them():
    # Ollama's format.HumanNumber: whole numbers bare, else one decimal for billions, two for millions
    assert [human_number(n) for n in (8_000_000_000, 7_615_616_512, 134_515_008, 268_000_000, 512_000, 999)] == [
        "8B", "7.6B", "134.52M", "268M", "512K", "999"]
