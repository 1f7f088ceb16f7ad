"""ProRL stem tasks as a NeMo Gym resources server: nemo_gym_prorl.gym.task_server over our StemEnvironment.

Its config's `task` picks the task YAML (default `stem/gym_mcqa_example`: NeMo Gym's own example rows, unchanged).
"""

from nemo_gym_prorl.gym.task_server import ProrlTaskConfig, ProrlTaskServer


class ProrlStemConfig(ProrlTaskConfig):
    task: str = "stem/gym_mcqa_example"


class ProrlStemServer(ProrlTaskServer):
    config: ProrlStemConfig


if __name__ == "__main__":
    ProrlStemServer.run_webserver()
