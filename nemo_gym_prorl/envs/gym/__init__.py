"""The ``gym`` task type: a NeMo Gym resources server is the environment."""
