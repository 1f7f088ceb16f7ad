"""The orchestrator side: agent loop, trajectories, rollouts."""
