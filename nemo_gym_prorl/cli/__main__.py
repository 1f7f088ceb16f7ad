"""`python -m nemo_gym_prorl.cli`: the `prorl` command."""

from nemo_gym_prorl.cli import main

main()
