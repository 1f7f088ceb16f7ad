"""ProRL SWE tasks as a NeMo Gym resources server: nemo_gym_prorl.gym.task_server over our SweEnvironment.

Its config's `task` picks the swe task YAML (default `swe/offline`). `/verify` takes the patch from the session's
live sandbox (`git add -A`, `git diff --cached` against the base), closes it, and grades the patch in a fresh
sandbox with the swebench harness; rows are SWE-bench rows, Gym's own swebench rows included.
"""

from nemo_gym_prorl.gym.task_server import ProrlTaskConfig, ProrlTaskServer


class ProrlSweConfig(ProrlTaskConfig):
    task: str = "swe/offline"


class ProrlSweServer(ProrlTaskServer):
    config: ProrlSweConfig


if __name__ == "__main__":
    ProrlSweServer.run_webserver()
