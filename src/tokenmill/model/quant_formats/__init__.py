"""GGUF tensor types as data: what each block holds (registry.py), gguf-py's exact dequantization
(dequantize.py; ggml's own for the types gguf-py cannot read yet, newer_types.py) and the file's
matrices kept as rows of blocks until the layer factory converts them (gguf_weight.py). The C++
side of each format lives with the kernels (csrc/, model/quant.py)."""

from tokenmill.model.quant_formats.dequantize import dequantize_rows
from tokenmill.model.quant_formats.gguf_weight import GGUFWeight
from tokenmill.model.quant_formats.registry import FORMATS, UNQUANTIZED, QuantFormat, format_of

__all__ = ["FORMATS", "UNQUANTIZED", "GGUFWeight", "QuantFormat", "dequantize_rows", "format_of"]
