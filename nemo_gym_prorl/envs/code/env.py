"""Code: the model writes a program; it is graded by running unit tests in a fresh sandbox (`grading.py`).

Rows are LiveCodeBench-style (NeMo Gym's ``code_gen`` rows as they are: stdin/stdout or call-based),
HumanEval-style or BigCodeBench's (Gym's ``bigcodebench`` rows: a unittest suite; `cases.py`). The tests run in
``verifier.image``, as the agent's own sandbox does: BigCodeBench's need the ``scientific`` image's pandas,
matplotlib and scikit-learn. The agent may try its code in its sandbox first: the problem is staged as ``problem.md`` and, with
``verifier.public_tests: N``, the first N tests as ``tests/<i>.in`` / ``tests/<i>.expected.out`` (``.json``
arguments and return value for call-based rows). Its answer is, in this order: a workspace file its final answer
names (``solution.py``), the last fenced code block of its final answer, the last ``python`` block it wrote during
the episode. A task without a ``prompt_template`` takes its first prompt from the row's ``responses_create_params``
(Gym rows keep their own prompts).
"""

from __future__ import annotations

import asyncio
import posixpath
import re
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from nemo_gym_prorl.contracts.sandbox import WORKSPACE, SandboxError
from nemo_gym_prorl.contracts.task import TaskInstance
from nemo_gym_prorl.envs.base import Episode, Evaluation, Probe, RowError, Submission
from nemo_gym_prorl.envs.code.cases import CodeProblem, final_code_block, problem_from_row
from nemo_gym_prorl.envs.code.grading import GradingSettings, grade_program
from nemo_gym_prorl.envs.row_prompt import GymRowPrompt
from nemo_gym_prorl.sandbox import images

_FILE_NAME = re.compile(r"^\s*`?((?:/workspace/)?[\w./-]+\.py)`?\s*$")
_PYTHON_BLOCK = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n(.*?)```", re.DOTALL)


class CodeVerifierSettings(GradingSettings):
    public_tests: int = Field(0, ge=0, description="tests staged in the agent's workspace to try its code on")
    image: str | None = Field(
        None, description="what the tests run in: an image of sandbox.images.IMAGES by name (`scientific`: pandas, "
        "matplotlib, scikit-learn, ...), built on first use, or an absolute path to a rootfs directory or a SIF; "
        "unset: the sandbox backend's default root (the host's Python for bubblewrap)",
    )  # fmt: skip

    @field_validator("image")
    @classmethod
    def _known_image(cls, image: str | None) -> str | None:
        if image is None or image in images.IMAGES or (Path(image).is_absolute() and Path(image).exists()):
            return image
        raise ValueError(f"expected an image name ({', '.join(images.IMAGES)}) or an existing absolute path")


def submitted_file(answer: str | None) -> str | None:
    """The workspace path an answer names (``solution.py``, ``/workspace/sol.py``), None when it names none."""
    match = _FILE_NAME.match(answer or "")
    if match is None:
        return None
    path = posixpath.normpath(match.group(1))
    return path.removeprefix(WORKSPACE + "/") if path.startswith(WORKSPACE + "/") else path


def submitted_code(answer: str | None, messages: list[dict[str, Any]]) -> tuple[str | None, str]:
    """(code, where it came from) from the final answer, else from the last python block the model generated (never
    from a task's worked example, which is an assistant message the model did not write)."""
    if answer and (block := final_code_block(answer)) is not None:
        return block, "answer code block"
    for message in reversed(messages):
        generated = message.get("role") == "assistant" and "generation_token_ids" in message
        if generated and isinstance(message.get("content"), str):
            blocks = _PYTHON_BLOCK.findall(message["content"])
            if blocks:
                return blocks[-1], "last python block"
    return None, "none"


class CodeEnvironment(GymRowPrompt):
    # Gym's code rows are answered by a reply holding the program, so a reply without a tool call is the answer.
    plain_reply_ends_episode = True

    Settings = CodeVerifierSettings

    def check_columns(self, instance: TaskInstance) -> None:
        try:
            problem_from_row(instance.data)
        except ValueError as e:
            raise RowError(None, str(e)) from None

    def probes(self, instance: TaskInstance) -> list[Probe]:
        """No program (0) and one that does nothing (0); a row's reference solution, where it has one, must pass (1):
        its ``canonical_solution`` (after HumanEval's ``prompt``, which it completes; BigCodeBench's is whole)."""
        probes = [Probe("empty", {"code": "", "source": "probe"}, 0.0),
                  Probe("does nothing", {"code": "pass\n", "source": "probe"}, 0.0)]  # fmt: skip
        solution = instance.data.get("canonical_solution")
        if solution:
            code = str(instance.data.get("prompt") or "") + str(solution)
            probes.insert(0, Probe("gold", {"code": code, "source": "probe"}, 1.0))
        return probes

    def problem(self, instance: TaskInstance) -> CodeProblem:
        try:
            return problem_from_row(instance.data)
        except ValueError as e:
            raise ValueError(f"task {self.task.name!r}, instance {instance.instance_id}: {e}") from None

    async def stage(self, episode: Episode) -> None:
        assert episode.sandbox is not None
        problem = self.problem(episode.instance)
        await episode.sandbox.write_file("problem.md", self.first_prompt(episode.instance)[-1]["content"].encode())
        suffix = ("json", "json") if problem.kind == "call" else ("in", "out")
        for i in range(min(self.settings.public_tests, len(problem.inputs))):
            await episode.sandbox.write_file(f"tests/{i}.{suffix[0]}", problem.inputs[i].encode())
            await episode.sandbox.write_file(f"tests/{i}.expected.{suffix[1]}", problem.outputs[i].encode())

    async def collect(self, episode: Episode) -> Submission:
        path = submitted_file(episode.answer)
        if path is not None and episode.sandbox is not None:
            try:
                return {"code": (await episode.sandbox.read_file(path)).decode(errors="replace"), "source": path}
            except (OSError, ValueError, SandboxError) as e:
                return {"code": None, "source": path, "error": f"could not read {path}: {e}"}
        code, source = submitted_code(episode.answer, episode.messages)
        return {"code": code, "source": source}

    async def sandbox_image(self) -> str | None:
        """`verifier.image`, where the agent tries its code and the tests run: a named image's rootfs is built on
        first use, minutes once per machine (concurrent callers wait for the one build, under the image cache's
        lock), then found cached."""
        name = self.settings.image
        if name not in images.IMAGES:
            return name
        return str(await asyncio.to_thread(images.build_rootfs, images.IMAGES[name]))

    async def grade(self, instance: TaskInstance, submission: Submission) -> Evaluation:
        problem = self.problem(instance)
        code = submission.get("code")
        if code is None and submission.get("answer") is not None:  # graded from an answer alone (Gym verify)
            code, submission = final_code_block(submission["answer"]), submission | {"source": "answer code block"}
        if not code or not code.strip():
            reason = submission.get("error") or "no code submitted (no fenced code block, no file named)"
            return Evaluation(reward=0.0, resolved=False, details={"reason": reason})
        evaluation = await grade_program(
            problem, code, self.settings, sandbox_backend=self.sandbox_backend, limits=self.task.limits,
            image=await self.sandbox_image(),
        )
        evaluation.details |= {"code_source": submission.get("source"), "kind": problem.kind}
        return evaluation


__all__ = ["CodeEnvironment", "CodeVerifierSettings", "submitted_code", "submitted_file"]
