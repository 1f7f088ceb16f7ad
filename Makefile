# nemo-gym-prorl: the two commands a new user needs are `make rollout` and `make test`.
.PHONY: setup rollout test

setup:
	@scripts/bootstrap.sh

# Real rollouts: the embedded local model, a bubblewrap sandbox, the default task (conf/config.yaml); summary at the end.
# Results and their resolved config land in outputs/rollout/<date>/<time>/ (rollouts.jsonl, rollouts.config.yaml);
# pass Hydra overrides through ARGS, e.g. make rollout ARGS="n_samples=4 limit=2".
rollout: setup
	.venv/bin/prorl rollout $(ARGS)

test: setup
	.venv/bin/python -X faulthandler -m pytest
