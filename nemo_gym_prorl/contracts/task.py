"""Task configs: a YAML under `tasks/` names a task type, its dataset, prompt, tools and limits — no code.

A task name (`math/arithmetic`) is looked up in the users' task folders first (`prorl` adds `DIR/tasks` for each
`--config-dir` / `hydra.searchpath` entry DIR), then in the package's own `tasks/`. Loading fails fast with one
line that names the file and what is wrong in it.
"""

from __future__ import annotations

import importlib.resources
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from nemo_gym_prorl.contracts.sandbox import SandboxLimits

# The package's tasks: in a checkout nemo_gym_prorl/tasks links to the top-level tasks/, a wheel carries a copy.
TASKS_DIR = Path(str(importlib.resources.files("nemo_gym_prorl") / "tasks"))


ToolCallFormatName = Literal["hermes", "openai", "codeact"]


TASK_TYPES: dict[str, str] = {
    "math": "nemo_gym_prorl.envs.math.env:MathEnvironment",
    "gym": "nemo_gym_prorl.envs.gym.env:GymResourcesEnvironment",
    "code": "nemo_gym_prorl.envs.code.env:CodeEnvironment",
    "stem": "nemo_gym_prorl.envs.stem.env:StemEnvironment",
    "swe": "nemo_gym_prorl.envs.swe.env:SweEnvironment",
}
"""The registry of task types: each type's environment class (in its folder of envs/), as module:class. It is
imported when a task of that type first runs."""


class TaskConfigError(ValueError):
    """A task YAML that cannot be used; the message names the file and the problem."""


class DatasetConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: Path = Field(description="JSONL or parquet file; relative paths are relative to the task YAML")
    id_key: str | None = Field(None, description="column holding the instance id; the row index when unset")
    validation_path: Path | None = Field(None, description="the validation split's own file; `path` is then train")
    validation_fraction: float = Field(
        0.1, ge=0, lt=1, description="without validation_path: the share of `path` held out for validation, chosen "
        "by a hash of each instance id (the same split every time, whatever the row order)",
    )  # fmt: skip


class ExampleMessage(BaseModel):
    """One message of a worked example: a user's question or observation, or the assistant's reply."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: str


_PINNED = re.compile(r"^(@?[A-Za-z0-9][A-Za-z0-9._/-]*)(==|@)[0-9][A-Za-z0-9.+-]*$")


class HarnessInstall(BaseModel):
    """What goes into the harness's layer, each package at one version: the layer is built once per list."""

    model_config = ConfigDict(extra="forbid")
    pip: list[str] = Field(default_factory=list, description="PyPI requirements, each `name==version`")
    npm: list[str] = Field(default_factory=list, description="npm packages, each `name@version`")

    @field_validator("pip", "npm")
    @classmethod
    def _pinned(cls, packages: list[str], info: ValidationInfo) -> list[str]:
        separator = "==" if info.field_name == "pip" else "@"
        for package in packages:
            match = _PINNED.match(package)
            if match is None or match.group(2) != separator:
                raise ValueError(f"expected a pinned name{separator}version, got {package!r}")
        return packages


class HarnessConfig(BaseModel):
    """An unmodified agent run in the task's sandbox in place of our loop, its model calls through the proxy."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(description="names the harness in trajectories and its layer in the image cache")
    install: HarnessInstall
    command: list[str] = Field(
        min_length=1, description="argv run in the workspace; `{prompt}`, `{workdir}`, `{config}`, `{model}` and "
        "the row's columns are filled in with str.format",
    )  # fmt: skip
    config_file: Path | None = Field(None, description="a file shipped beside the task YAML, bound in as {config}")
    env: dict[str, str] = Field(default_factory=dict, description="added to the proxy's OPENAI_BASE_URL/API_KEY")
    max_turns: int = Field(20, ge=1, description="model calls the proxy answers before the harness is stopped")
    timeout_s: float = Field(600.0, gt=0, description="the harness process's wall clock")
    collect: Literal["workspace_patch", "answer_file"] = Field(
        "workspace_patch", description="the SWE env's patch of the workspace, or the text of `answer_file`",
    )  # fmt: skip
    answer_file: str | None = Field(
        None, validate_default=True, description="collect answer_file: its path, relative to the workspace",
    )  # fmt: skip

    @field_validator("answer_file")
    @classmethod
    def _named_when_collected(cls, answer_file: str | None, info: ValidationInfo) -> str | None:
        if (info.data.get("collect") == "answer_file") != (answer_file is not None):
            raise ValueError("expected a path exactly when collect is answer_file")
        if answer_file is not None and (answer_file.startswith("/") or ".." in Path(answer_file).parts):
            raise ValueError(f"expected a path inside the workspace, relative to it, got {answer_file!r}")
        return answer_file


class TaskConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt key is an error, not a silent default
    name: str
    type: str = Field(description="a task type of TASK_TYPES")
    dataset: DatasetConfig
    system_prompt: str = ""
    prompt_template: str = Field("", description="str.format template over the dataset row's columns")
    examples: list[ExampleMessage] = Field(
        default_factory=list, description="a worked conversation (user, assistant, user, ..., assistant) between the "
        "system prompt and the task's prompt: a small model follows turns it has seen far better than instructions",
    )  # fmt: skip
    tools: list[str] = Field(default_factory=list)
    tool_call_format: ToolCallFormatName | None = Field(None, description="overrides the model's default")
    max_turns: int = Field(8, ge=1)
    tool_timeout_s: float = Field(30.0, gt=0)
    limits: SandboxLimits = Field(default_factory=SandboxLimits)
    verifier: dict[str, Any] = Field(default_factory=dict, description="settings of the task type's grader")
    resources_server_url: str | None = Field(None, description="type gym: the NeMo Gym resources server")
    harness: HarnessConfig | None = Field(None, description="run this agent instead of our loop and tools")
    _source: Path | None = PrivateAttr(None)  # the YAML it was loaded from, for error lines

    @property
    def origin(self) -> str:
        """How an error line names this task: its file when it came from one."""
        return f"task file {self._source}" if self._source is not None else f"task {self.name!r}"

    @field_validator("type")
    @classmethod
    def _registered_type(cls, task_type: str) -> str:
        if task_type not in TASK_TYPES:
            raise ValueError(f"expected one of {', '.join(TASK_TYPES)}, got {task_type!r}")
        return task_type

    @field_validator("examples")
    @classmethod
    def _turns_alternate(cls, examples: list[ExampleMessage]) -> list[ExampleMessage]:
        roles = [message.role for message in examples]
        if roles != ["user", "assistant"] * (len(roles) // 2):
            raise ValueError("examples must alternate user, assistant, ... and end with the assistant's reply")
        return examples

    @field_validator("harness")
    @classmethod
    def _harness_brings_its_tools(cls, harness: HarnessConfig | None, info: ValidationInfo) -> HarnessConfig | None:
        if harness is not None and info.data.get("tools"):
            raise ValueError("a harness brings its own tools: expected tools: [] beside it")
        if harness is not None and harness.collect == "workspace_patch" and info.data.get("type") != "swe":
            raise ValueError(f"collect: workspace_patch is the swe env's patch; a {info.data.get('type')} task "
                             "collects its answer from a file: expected collect: answer_file")  # fmt: skip
        return harness

    def example_messages(self) -> list[dict[str, Any]]:
        """The worked example as chat messages, to go before the task's prompt."""
        return [message.model_dump() for message in self.examples]


def task_path(name: str, search_dirs: Sequence[Path] = ()) -> Path:
    """`math/arithmetic` -> the first `<dir>/math/arithmetic.yaml` in `search_dirs`, else the package's
    tasks/math/arithmetic.yaml (existing or not); a path to a YAML is taken as is."""
    candidate = Path(name)
    if candidate.suffix in (".yaml", ".yml"):
        return candidate
    for folder in search_dirs:
        found = folder / f"{name}.yaml"
        if found.is_file():
            return found
    return TASKS_DIR / f"{name}.yaml"


def known_tasks(search_dirs: Sequence[Path] = ()) -> list[str]:
    """The task names in `search_dirs` and the package's tasks/: their YAMLs that are task files (a `type` or an
    `extends`; a folder may keep other YAMLs, as swe/offline keeps its generator's suite)."""
    folders = [*search_dirs, TASKS_DIR]
    return sorted({str(p.relative_to(d).with_suffix("")) for d in folders for p in d.rglob("*.yaml") if _is_task(p)})


def _is_task(path: Path) -> bool:
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError:
        return True  # a task file with a typo: loading it says where
    return isinstance(raw, dict) and ("type" in raw or "extends" in raw)


def load_task(name: str, search_dirs: Sequence[Path] = ()) -> TaskConfig:
    path = task_path(name, search_dirs)
    if not path.is_file():
        known = ", ".join(known_tasks(search_dirs))
        raise TaskConfigError(f"unknown task {name!r}: no {path}; known tasks: {known}")
    raw = _task_mapping(path, search_dirs, ())
    try:
        task = TaskConfig.model_validate(raw)
    except ValidationError as e:
        raise TaskConfigError(f"task file {path}: {field_error(e, TaskConfig)}") from None
    for key in ("path", "validation_path"):
        file = getattr(task.dataset, key)
        if file is not None and not file.is_file():
            raise TaskConfigError(f"task file {path}: field 'dataset.{key}': no file {file}")
    if task.harness is not None and task.harness.config_file is not None and not task.harness.config_file.is_file():
        raise TaskConfigError(f"task file {path}: field 'harness.config_file': no file {task.harness.config_file}")
    task._source = path
    return task


def field_error(error: ValidationError, model: type[BaseModel], prefix: str = "", show_input: bool = False) -> str:
    """``field '<prefix><path>': <why>`` for the first error of validating `model` (a task file, or a task type's
    verifier settings under ``verifier.``): an unknown key lists the keys known there."""
    first = error.errors()[0]
    why = first["msg"] + (f", got {first.get('input')!r}" if show_input else "")
    if first["type"] == "extra_forbidden":
        why = f"unknown key; known: {', '.join(_keys_at(model, first['loc'][:-1])) or 'none'}"
    return f"field {prefix + '.'.join(str(p) for p in first['loc'])!r}: {why}"


def _keys_at(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The keys `model` may hold at `loc` (() the top, ("limits",) a task file's limits)."""
    for key in loc:
        if isinstance(key, int):  # an item of a list: its model is the list's
            continue
        if str(key) not in model.model_fields:
            return []
        annotation = model.model_fields[str(key)].annotation
        # an optional section (`harness: HarnessConfig | None`) lists its model's keys
        found = [a for a in (annotation, *get_args(annotation)) if isinstance(a, type) and issubclass(a, BaseModel)]
        if not found:
            return []
        model = found[0]
    return list(model.model_fields)


def _task_mapping(path: Path, search_dirs: Sequence[Path], seen: tuple[Path, ...]) -> dict[str, Any]:
    """A task file's mapping, laid over the task it `extends` (mappings merged key by key, anything else replaced),
    its dataset files made absolute against the file that names them."""
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise TaskConfigError(f"task file {path} is not valid YAML{where}: {getattr(e, 'problem', e)}") from None
    if not isinstance(raw, dict):
        raise TaskConfigError(f"task file {path} must hold a mapping, got {type(raw).__name__}")
    dataset = raw.get("dataset")
    if isinstance(dataset, dict):
        for key in ("path", "validation_path"):
            if isinstance(dataset.get(key), str):
                dataset[key] = (path.parent / dataset[key]).resolve()
    harness = raw.get("harness")
    if isinstance(harness, dict) and isinstance(harness.get("config_file"), str):
        harness["config_file"] = (path.parent / harness["config_file"]).resolve()
    base = raw.pop("extends", None)
    if base is None:
        return raw
    base_path = task_path(base, search_dirs) if isinstance(base, str) else None
    if base_path is None or not base_path.is_file():
        raise TaskConfigError(f"task file {path}: field 'extends': expected the name of a task, got {base!r}")
    if base_path.resolve() in seen:
        raise TaskConfigError(f"task file {path}: field 'extends': {base!r} extends itself")
    return _merged(_task_mapping(base_path, search_dirs, (*seen, path.resolve())), raw)


def _merged(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            value = _merged(merged[key], value)
        merged[key] = value
    return merged


class TaskInstance(BaseModel):
    instance_id: str
    data: dict[str, Any]
    prompt: list[dict[str, Any]] | None = Field(None, description="its first prompt, rendered once when accepted")
