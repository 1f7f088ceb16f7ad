"""Task environments, by task type."""

from __future__ import annotations

from nemo_gym_prorl.envs.base import Environment, Episode, Evaluation
from nemo_gym_prorl.envs.code import CodeEnvironment
from nemo_gym_prorl.envs.gym_resources import GymResourcesEnvironment
from nemo_gym_prorl.envs.math import MathEnvironment
from nemo_gym_prorl.envs.stem import StemEnvironment
from nemo_gym_prorl.envs.swe import SweEnvironment
from nemo_gym_prorl.envs.task import TaskConfig

_TYPES: dict[str, type[Environment]] = {
    "math": MathEnvironment,
    "gym": GymResourcesEnvironment,
    "code": CodeEnvironment,
    "stem": StemEnvironment,
    "swe": SweEnvironment,
}


def make_environment(task: TaskConfig, sandbox_backend: str) -> Environment:
    return _TYPES[task.type](task, sandbox_backend)


__all__ = ["Environment", "Episode", "Evaluation", "make_environment"]
