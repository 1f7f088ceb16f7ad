# nemo-gym-prorl: the two commands a new user needs are `make rollout` and `make test`.
.PHONY: setup rollout test

setup:
	@scripts/bootstrap.sh

# Real rollouts: the embedded local model, a bubblewrap sandbox, the math task; summary printed at the end.
# Results and their resolved config land in outputs/rollout/<date>/<time>/ (rollouts.jsonl, rollouts.config.yaml);
# pass Hydra overrides through ARGS, e.g. make rollout ARGS="n_samples=4 limit=2".
rollout: setup
	.venv/bin/prorl rollout $(ARGS)

# The interactive-shell tests (Ctrl-C reaching a command in the sandbox's pty) run in a pytest process of their own:
# in one detached process with the whole suite, they fail after earlier tests (cause under investigation, see the
# issue notes); alone they pass. Every test runs, in one of the two processes.
SHELL_TESTS = tests/test_pty_shell.py tests/test_sandbox_backends.py tests/test_tools.py
test: setup
	.venv/bin/python -m pytest $(SHELL_TESTS)
	.venv/bin/python -m pytest $(foreach t,$(SHELL_TESTS),--ignore=$(t))
