"""The repository inside a sandbox: staged on its base, and the agent's change taken out as a patch.

Staging puts the tree in the workspace (from the tar of ``swe_repo``, or copied from ``/testbed`` in the image),
removes the files ``test_patch`` creates (the hidden tests: the offline suite's come from the source tree),
applies the row's ``base_patch`` (how the offline suite makes its bugs), and commits it as the
one root commit of a fresh repository with a fixed author and date: no remotes, no history to ``git log`` the fix
out of, and the same commit id on every staging of the same tree. The hidden tests of ``test_patch`` are not
there: they come only at evaluation.

Extraction runs in the run's sandbox while it is alive: ``git add -A`` and ``git diff --cached`` against the base
commit (new files included). Binary diffs are dropped (with a note): ``git apply`` cannot use them without
``--binary`` and SWE-bench patches are text. A patch over the size cap is dropped whole, with a note, since a
truncated patch does not apply.
"""

from __future__ import annotations

import re

from pydantic import BaseModel

from nemo_gym_prorl.sandbox import Sandbox, SandboxError
from nemo_gym_prorl.tools.python import STATE_DIR

WORKDIR = "/workspace"
BASE_DATE = "2000-01-01T00:00:00+00:00"
_STAGE_TAR = ".prorl-stage.tar"
_BASE_PATCH = ".prorl-base.patch"
_PATCH_OUT = ".prorl-patch.diff"
_GIT_IDENTITY = ["-c", "user.name=prorl", "-c", "user.email=prorl@localhost", "-c", "init.defaultBranch=main"]
_TOOL_STATE = STATE_DIR.split("/", 1)[0]  # the python tool's interpreter lives in the workspace: never in a patch
_IGNORED = f"__pycache__/\\n*.pyc\\n.pytest_cache/\\n/{_TOOL_STATE}/\\n"

_STAGE = f"""set -euo pipefail
cd {WORKDIR}
if [ -f {_STAGE_TAR} ]; then
  tar -xf {_STAGE_TAR} --no-same-owner --no-same-permissions && rm -f {_STAGE_TAR}
elif [ -d /testbed ]; then
  cp -a /testbed/. .
else
  echo "no repository to stage: the row has no repo_source and the image has no /testbed" >&2; exit 3
fi
rm -rf .git
for hidden in "$@"; do rm -rf -- "$hidden"; done
if [ -f {_BASE_PATCH} ]; then
  mkdir -p /tmp/prorl-stage && mv {_BASE_PATCH} /tmp/prorl-stage/base.patch
  git apply --whitespace=nowarn /tmp/prorl-stage/base.patch
fi
git {' '.join(_GIT_IDENTITY)} init -q
printf '{_IGNORED}' >> .git/info/exclude
git config user.name agent && git config user.email agent@localhost
git add -A
GIT_AUTHOR_DATE={BASE_DATE} GIT_COMMITTER_DATE={BASE_DATE} git {' '.join(_GIT_IDENTITY)} commit -q --no-verify \\
  --allow-empty -m base
git rev-parse HEAD
"""

_EXTRACT = f"""cd {WORKDIR} 2>/dev/null || {{ echo "the workspace is gone"; exit 3; }}
git rev-parse --verify -q "$1^{{commit}}" >/dev/null || {{ echo "the repository no longer holds the base commit \
$1 (.git removed or rewritten)"; exit 4; }}
git add -A . ":(exclude){_PATCH_OUT}" || exit 5
git diff --cached --no-color --no-ext-diff --no-textconv "$1" -- . ":(exclude){_PATCH_OUT}" ":(exclude){_TOOL_STATE}" \
  > {_PATCH_OUT} || exit 5
"""


class StagingError(SandboxError):
    """The repository could not be staged in the sandbox (the message says why)."""


class ExtractedPatch(BaseModel):
    patch: str
    notes: list[str] = []


async def stage_repository(
    sandbox: Sandbox, tree: bytes | None, base_patch: str, timeout_s: float, hidden: list[str] = ()
) -> str:
    """Stage the base in the sandbox's workspace, without the `hidden` files; the base commit's id."""
    if tree is not None:
        await sandbox.write_file(_STAGE_TAR, tree)
    if base_patch:
        await sandbox.write_file(_BASE_PATCH, base_patch.encode())
    result = await sandbox.exec(["bash", "-c", _STAGE, "prorl", *hidden], timeout=timeout_s)
    if result.exit_code != 0:
        why = "timed out" if result.timed_out else f"exit {result.exit_code}"
        raise StagingError(f"staging the repository failed ({why}): {result.output.strip()[-2000:]}")
    return result.output.strip().splitlines()[-1]


async def extract_patch(sandbox: Sandbox, base_commit: str, max_bytes: int, timeout_s: float) -> ExtractedPatch:
    """The agent's change against the base commit, as a text diff (see the module docstring)."""
    result = await sandbox.exec(["bash", "-c", _EXTRACT, "prorl", base_commit], timeout=timeout_s)
    if result.exit_code != 0:
        why = "timed out" if result.timed_out else result.output.strip()[-1000:] or f"exit {result.exit_code}"
        return ExtractedPatch(patch="", notes=[f"no patch could be extracted: {why}"])
    raw = await sandbox.read_file(_PATCH_OUT)
    return clean_patch(raw.decode(errors="replace"), max_bytes)


_FILE_HEADER = re.compile(r"^diff --git ", re.M)


def clean_patch(diff: str, max_bytes: int) -> ExtractedPatch:
    """`diff` without binary file sections, or nothing if it is over `max_bytes`."""
    notes = []
    starts = [m.start() for m in _FILE_HEADER.finditer(diff)]
    sections = [diff[a:b] for a, b in zip(starts, [*starts[1:], len(diff)], strict=False)]
    kept = []
    for section in sections:
        if "\nGIT binary patch\n" in section or re.search(r"^Binary files .* differ$", section, re.M):
            notes.append(f"binary diff dropped: {section.splitlines()[0].removeprefix('diff --git ')}")
        else:
            kept.append(section)
    patch = "".join(kept)
    size = len(patch.encode())
    if size > max_bytes:
        notes.append(f"patch dropped: {size} bytes is over the cap of {max_bytes} bytes")
        patch = ""
    return ExtractedPatch(patch=patch, notes=notes)
