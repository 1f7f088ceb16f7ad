"""What crosses a boundary: jobs, tasks, trajectories, sampling, sandboxes; data only, light imports."""
