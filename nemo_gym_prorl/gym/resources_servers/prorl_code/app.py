"""ProRL code tasks as a NeMo Gym resources server: nemo_gym_prorl.gym.task_server over our CodeEnvironment.

Its config's `task` picks the task YAML (default `code/gym_code_gen_example`: NeMo Gym's own example rows, unchanged).
"""

from nemo_gym_prorl.gym.task_server import ProrlTaskConfig, ProrlTaskServer


class ProrlCodeConfig(ProrlTaskConfig):
    task: str = "code/gym_code_gen_example"


class ProrlCodeServer(ProrlTaskServer):
    config: ProrlCodeConfig


if __name__ == "__main__":
    ProrlCodeServer.run_webserver()
