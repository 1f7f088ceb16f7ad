"""The rollout viewer: `prorl view FILE` and a running service's ``/ui`` (see app.py)."""
