"""Task environments, by task type.

Each type's module is imported when the first environment of that type is made, and `Environment`, `Episode` and
`Evaluation` when first asked for: they bring in the tools, the graders and NeMo Gym (seconds), which a command that
only reads task YAMLs (`prorl ... --help`, a config error) does not need.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from nemo_gym_prorl.contracts.task import TASK_TYPES, TaskConfig

if TYPE_CHECKING:
    from nemo_gym_prorl.envs.base import Environment, Episode, Evaluation

def environment_class(task_type: str) -> type[Environment]:
    module, _, name = TASK_TYPES[task_type].partition(":")
    return getattr(importlib.import_module(module), name)


def make_environment(task: TaskConfig, sandbox_backend: str) -> Environment:
    return environment_class(task.type)(task, sandbox_backend)


def __getattr__(name: str) -> Any:
    if name in ("Environment", "Episode", "Evaluation"):
        from nemo_gym_prorl.envs import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Environment", "Episode", "Evaluation", "environment_class", "make_environment"]
