"""What a rollout leaves to look at: stage clocks, traces (and their OTLP export), run reports."""
