"""The names `--quantization` accepts, apart from the layers that act on them.

`tokenmill.config` validates them, and config is imported by every process of the server, including
the API process and the detokenizer, which never hold a tensor: the layer factory that gives the names
their meaning imports torch, so the names live here, torch-free, and both sides import them.
"""

from __future__ import annotations

# auto: keep a file's quantized weights as they are; none: dequantize them; int8 / int4: also
# quantize dense weights at load (model/layers/factory.py).
QUANTIZATIONS = ("auto", "none", "int8", "int4")
# How quantized GGUF weights run prompt steps (many rows): auto: per format and CPU; vnni: the
# blocked two-term int8 kernel on the file's values (VNNI or AVX2); bf16 / fp32: dequantize + a bf16 /
# fp32 GEMM (model/layers/quantized_linear.py `prompt_gemm_for`).
PROMPT_GEMMS = ("auto", "vnni", "bf16", "fp32")
