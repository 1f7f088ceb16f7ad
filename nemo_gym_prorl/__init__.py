"""nemo-gym-prorl: rollout-as-a-service for RL training of multi-turn LLM agents, as a NeMo Gym plugin."""

__version__ = "0.1.0"
