"""Training through the rollout service: trainer adapters (TRL) and the live policy that serves every turn."""
