"""First prompts from Gym rows, for task types whose rows may be NeMo Gym's own (code, stem).

A task with a ``prompt_template`` formats it over the row as usual. A task without one takes the row's
``responses_create_params.input``, converted exactly as a ``gym`` task converts it (Gym's own ResponsesConverter),
so Gym's rows work unchanged.
"""

from __future__ import annotations

from typing import Any

from nemo_gym_prorl.contracts.task import TaskInstance
from nemo_gym_prorl.envs.base import Environment
from nemo_gym_prorl.envs.gym.env import row_prompt_messages


class GymRowPrompt(Environment):
    def prompt_messages(self, instance: TaskInstance) -> list[dict[str, Any]]:
        if self.task.prompt_template or "responses_create_params" not in instance.data:
            return super().prompt_messages(instance)
        return row_prompt_messages(instance.data)
