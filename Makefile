# nemo-gym-prorl: the two commands a new user needs are `make rollout` and `make test`.
.PHONY: setup rollout test

setup:
	@scripts/bootstrap.sh

# Real rollouts: the embedded local model, a bubblewrap sandbox, the math task; summary printed at the end.
rollout: setup
	.venv/bin/prorl rollout

test: setup
	.venv/bin/python -m pytest
