"""A rollout's inner loop: the agent loop, the turn generators over the model backends, and the LLM pool."""
