"""nemo-gym-prorl: rollout-as-a-service for RL training of multi-turn LLM agents, as a NeMo Gym plugin."""

import os

# Importing nemo_gym points HF_HOME and HF_DATASETS_CACHE at <cwd>/cache when they are unset, which would make
# every dataset load write a cache into whatever directory the user runs from. Keep Hugging Face's own defaults.
_HF_HOME = os.environ.setdefault("HF_HOME", os.path.join(os.path.expanduser("~"), ".cache", "huggingface"))
os.environ.setdefault("HF_DATASETS_CACHE", os.path.join(_HF_HOME, "datasets"))

__version__ = "0.1.0"
