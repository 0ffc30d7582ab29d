"""Maps an architecture name (HF `model_type`, after GGUF names are mapped) to its model class."""

from __future__ import annotations

from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.moe import MoEForCausalLM

ARCHITECTURES: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "qwen3_moe": MoEForCausalLM,
    "qwen2_moe": MoEForCausalLM,
    "mixtral": MoEForCausalLM,
}


def model_class(architecture: str) -> type[LlamaForCausalLM]:
    try:
        return ARCHITECTURES[architecture]
    except KeyError:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise ValueError(f"unsupported architecture {architecture!r} (supported: {supported})") from None
