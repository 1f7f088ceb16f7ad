"""ProRL math as a NeMo Gym resources server: nemo_gym_prorl.gym.task_server over our MathEnvironment.

Its config's `task` picks the math task YAML (default `math/arithmetic`). One Gym session is one episode, a
bubblewrap sandbox with the problem staged; `/bash`, `/python` and `/finish` run there; `/verify` grades the
`finish` answer (else the final assistant message) with math-verify and closes the sandbox.
"""

from nemo_gym_prorl.gym.task_server import ProrlTaskConfig, ProrlTaskServer


class ProrlMathConfig(ProrlTaskConfig):
    task: str = "math/arithmetic"


class ProrlMathServer(ProrlTaskServer):
    config: ProrlMathConfig


if __name__ == "__main__":
    ProrlMathServer.run_webserver()
