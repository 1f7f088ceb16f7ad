"""Bringing the service up from a config: its runtime (models, sandboxes, Ray), checks before start, jobs, serving."""
