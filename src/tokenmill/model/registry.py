"""Maps an architecture name (HF `model_type`, after GGUF names are mapped) to its model class."""

from __future__ import annotations

from tokenmill.model.gemma import GemmaForCausalLM
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.moe import MoEForCausalLM

ModelClass = type[LlamaForCausalLM] | type[GemmaForCausalLM]  # MoEForCausalLM is a LlamaForCausalLM

ARCHITECTURES: dict[str, ModelClass] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "qwen3_moe": MoEForCausalLM,
    "qwen2_moe": MoEForCausalLM,
    "mixtral": MoEForCausalLM,
    "gemma2": GemmaForCausalLM,
    "gemma3": GemmaForCausalLM,
}


def model_class(architecture: str) -> ModelClass:
    try:
        return ARCHITECTURES[architecture]
    except KeyError:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise ValueError(f"unsupported architecture {architecture!r} (supported: {supported})") from None
