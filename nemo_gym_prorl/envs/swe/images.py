"""Which image a SWE instance runs in: a template over the row's fields naming a SIF file or a rootfs directory.

``image`` in a swe task's verifier settings:

- unset: the sandbox backend's default root (then the repository comes from ``repo_source``);
- ``default-rootfs`` / ``default-sif``: the image ``prorl image build [--sif]`` builds (Debian with python3,
  pytest, git, patch and a C compiler), which the offline suite runs in;
- a path without ``{``: one image shared by every instance;
- a template, e.g. ``/images/{swebench_image}.sif``, over the row's fields plus the usual image names:
  ``swebench_image`` (``sweb.eval.x86_64.<id>`` with ``__`` spelled ``_1776_``, as SWE-bench names its images),
  ``swegym_image`` (``__`` spelled ``_s_``, SWE-Gym's), ``docker_image_name`` (an R2E-Gym row's ``docker_image``
  with ``/`` and ``:`` as ``_``).

A relative path is relative to the task YAML's directory. An image that is not there is an ``ImageNotFound``
naming the path it looked for (the rollout ends as ``critical_error=init``).
"""

from __future__ import annotations

from pathlib import Path

from nemo_gym_prorl.envs.swe.rows import SweRow
from nemo_gym_prorl.sandbox import images

_DEFAULT_IMAGES = ("default-rootfs", "default-sif")


class ImageNotFound(FileNotFoundError):
    pass


def image_fields(row: SweRow) -> dict[str, str]:
    lowered = row.instance_id.lower()
    names = {
        "swebench_image": f"sweb.eval.x86_64.{lowered.replace('__', '_1776_')}",
        "swegym_image": f"sweb.eval.x86_64.{lowered.replace('__', '_s_')}",
        "docker_image_name": (row.docker_image or "").replace("/", "_").replace(":", "_"),
    }
    return {k: str(v) for k, v in row.fields.items()} | row.model_dump(include={"instance_id", "repo", "version"}) | names


def resolve_image(template: str | None, row: SweRow, base_dir: Path) -> str | None:
    """The image path for `row`, checked to exist; None for the backend's default root."""
    if not template:
        return None
    if template in _DEFAULT_IMAGES:
        return _default_image(template)
    try:
        path = Path(template.format(**image_fields(row)))
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"row {row.instance_id}: image template {template!r} cannot be filled: {e!r}") from None
    path = path if path.is_absolute() else base_dir / path
    if not path.exists():
        raise ImageNotFound(f"image for {row.instance_id} not found: no file or directory {path}")
    return str(path)


def _default_image(name: str) -> str:
    rootfs = images.rootfs_path(images.ImageSpec())
    path = images.sif_path(rootfs) if name == "default-sif" else rootfs
    built = path.is_file() if name == "default-sif" else images.is_built(rootfs)
    if not built:
        flag = " --sif" if name == "default-sif" else ""
        raise ImageNotFound(f"image {name} not found: no {path} (build it with `prorl image build{flag}`)")
    return str(path)
