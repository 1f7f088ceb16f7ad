"""Unmodified agent harnesses (mini-swe-agent, Codex CLI, ...) in our sandboxes, their model calls kept token-exact.

A rollout's harness talks to a model proxy of its own (`proxy.py`) that speaks the harness's API
(`chat_completions.py`, `responses.py`, `messages.py`, sharing `wire.py`) over one core (`calls.py`:
token-in/token-out through the LLM pool, every call recorded, the rollout's limits enforced); `segments.py` turns
the recorded calls into contiguous training segments. Design: docs/harness.md.
"""
