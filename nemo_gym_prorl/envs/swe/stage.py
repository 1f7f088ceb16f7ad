"""The repository inside a sandbox: staged on its base, and the agent's change taken out as a patch.

Staging puts the tree in the workspace, mounted where the repository lives in SWE-bench / SWE-Gym / R2E-Gym images
(``/testbed``, so their eval scripts and the editable installs of their environments find it; see ``SweSettings``),
from a tar: ``swe_repo``'s for a ``repo_source``, else the image's own ``/testbed`` taken out once (``image_tree``),
since the workspace mounted there hides it. It removes the files ``test_patch`` creates (the hidden tests come only
at evaluation), applies the row's ``base_patch`` (how the offline suite makes its bugs), installs a ``src/`` layout
(``INSTALL_COMMAND``: its tests cannot import it from the checkout otherwise), and commits it as the one root commit
of a fresh repository with a fixed author and date: no remotes, no history to ``git log`` the fix out of, and the
same commit id on every staging of the same tree.

Extraction runs in the run's live sandbox: ``git add -A`` and ``git diff --cached`` against the base commit (new
files included); a fork adds only the paths its overlay changed, to a fresh index of the base. Binary diffs (``git
apply`` needs ``--binary``) and a patch over the size cap (a truncated one does not apply) are dropped, with a note.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import re
from pathlib import Path

from pydantic import BaseModel

from nemo_gym_prorl.envs.swe import repo as swe_repo
from nemo_gym_prorl.sandbox import Sandbox, SandboxError, SandboxLimits, SandboxSpec, open_sandbox
from nemo_gym_prorl.tools.python import STATE_DIR

WORKDIR = "/testbed"
"""Where SWE-bench, SWE-Gym and R2E-Gym images hold the repository, and where it is staged (the default)."""
BASE_DATE = "2000-01-01T00:00:00+00:00"
_STAGE_TAR = ".prorl-stage.tar"
_BASE_PATCH = ".prorl-base.patch"
_PATCH_OUT = ".prorl-patch.diff"
_INLINE, _IN_FILE = "prorl-patch-inline", "prorl-patch-in-file"  # how the extraction says where its patch is
_GIT_IDENTITY = ["-c", "user.name=prorl", "-c", "user.email=prorl@localhost", "-c", "init.defaultBranch=main"]
_TOOL_STATE = STATE_DIR.split("/", 1)[0]  # the python tool's interpreter lives in the workspace: never in a patch
_IGNORED = f"__pycache__/\\n*.pyc\\n.pytest_cache/\\n/{_TOOL_STATE}/\\n/.local/\\n"
INSTALL_COMMAND = ("python3 -m pip install --quiet --user --break-system-packages --no-build-isolation --no-deps "
                   "--no-index --no-cache-dir --no-warn-script-location --editable .")  # fmt: skip
"""How a src-layout project is installed: as its packaging says (its build backend, from the image), offline, into
the sandbox user's site, ``.local/`` in the workspace (HOME; the image is read-only), which git ignores. It runs
before ``git init`` (version plugins read PKG-INFO, not the fresh repository), so no patch or diff holds what it
wrote. A tree is a src layout when ``src/`` holds Python files beside a pyproject.toml or setup.py."""
_INSTALL_FAILED = 20

_STAGE = f"""set -euo pipefail
cd "$1" && install=$2 && shift 2
mkdir -p /tmp/prorl-stage
tar -xf {_STAGE_TAR} --no-same-owner --no-same-permissions && rm -f {_STAGE_TAR}
rm -rf .git
for hidden in "$@"; do rm -rf -- "$hidden"; done
if [ -f {_BASE_PATCH} ]; then
  mv {_BASE_PATCH} /tmp/prorl-stage/base.patch
  git apply --whitespace=nowarn /tmp/prorl-stage/base.patch
fi
src_layout() {{ [ -n "$(find src -maxdepth 3 -name '*.py' -print -quit 2>/dev/null)" ] && [ -f pyproject.toml -o -f setup.py ]; }}
if [ -n "$install" ] && src_layout; then
  bash -c "$install" > /tmp/prorl-stage/install.log 2>&1 || {{ tail -n 15 /tmp/prorl-stage/install.log; exit {_INSTALL_FAILED}; }}
fi
git {' '.join(_GIT_IDENTITY)} init -q
printf '{_IGNORED}' >> .git/info/exclude
git config user.name agent && git config user.email agent@localhost
git add -A
GIT_AUTHOR_DATE={BASE_DATE} GIT_COMMITTER_DATE={BASE_DATE} git {' '.join(_GIT_IDENTITY)} commit -q --no-verify \\
  --allow-empty -m base
git rev-parse HEAD
"""

_EXTRACT = f"""cd "$1" 2>/dev/null || {{ echo "the workspace is gone"; exit 3; }}
base=$2 inline=$3
shift 3
git rev-parse --verify -q "$base^{{commit}}" >/dev/null || {{ echo "the repository no longer holds the base commit \
$base (.git removed or rewritten)"; exit 4; }}
if [ $# -gt 0 ]; then  # the paths a fork changed: a fresh index of the base with those added, ignored ones left out
  tmp=$(mktemp -d) && export GIT_INDEX_FILE=$tmp/index LC_ALL=C
  printf './%s\\0' "$@" | sort -zu > "$tmp/changed"  # ./: a name that starts with ':' is no pathspec magic
  git check-ignore -z --stdin < "$tmp/changed" | sort -zu > "$tmp/ignored"
  comm -z -23 "$tmp/changed" "$tmp/ignored" > "$tmp/added"
  git read-tree "$base" 2>/dev/null && {{ [ ! -s "$tmp/added" ] || GIT_LITERAL_PATHSPECS=1 git add -A \\
    --pathspec-from-file="$tmp/added" --pathspec-file-nul >/dev/null 2>&1; }} || unset GIT_INDEX_FILE  # amiss: as below
fi
if [ -z "${{GIT_INDEX_FILE:-}}" ]; then
  err=$(git add -A . ":(exclude){_PATCH_OUT}" 2>&1) || {{ echo "$err"; exit 5; }}
fi
err=$(git diff --cached --no-color --no-ext-diff --no-textconv "$base" -- . ":(exclude){_PATCH_OUT}" \
  ":(exclude){_TOOL_STATE}" 2>&1 > {_PATCH_OUT}) || {{ echo "$err"; exit 5; }}
size=$(stat -c %s {_PATCH_OUT})
if [ "$size" -le "$inline" ]; then echo {_INLINE}; base64 -w0 {_PATCH_OUT}; else echo "{_IN_FILE} $size"; fi
"""


class StagingError(SandboxError):
    """The repository could not be staged in the sandbox (the message says why)."""


class ExtractedPatch(BaseModel):
    patch: str
    notes: list[str] = []


async def stage_repository(
    sandbox: Sandbox, workdir: str, tree: bytes, base_patch: str, timeout_s: float, hidden: list[str] = (),
    install: bool = False,
) -> str:
    """Stage `tree` (a tar) with `base_patch` in the sandbox's workspace `workdir`, without the `hidden` files, and
    with `install` a src-layout project installed (see the module docstring); the base commit's id."""
    await sandbox.write_file(_STAGE_TAR, tree)
    if base_patch:
        await sandbox.write_file(_BASE_PATCH, base_patch.encode())
    argv = ["bash", "-c", _STAGE, "prorl", workdir, INSTALL_COMMAND if install else "", *hidden]
    result = await sandbox.exec(argv, timeout=timeout_s)
    if result.exit_code == _INSTALL_FAILED:
        raise StagingError(f"installing the project failed ({INSTALL_COMMAND}); pip's last lines:\n"
                           f"{result.output.strip()}")  # fmt: skip
    if result.exit_code != 0:
        why = "timed out" if result.timed_out else f"exit {result.exit_code}"
        raise StagingError(f"staging the repository failed ({why}): {result.output.strip()[-2000:]}")
    return result.output.strip().splitlines()[-1]


async def extract_patch(
    sandbox: Sandbox, workdir: str, base_commit: str, max_bytes: int, timeout_s: float, max_output_bytes: int,
    changed: list[str] | None = None,
) -> ExtractedPatch:
    """The agent's change against the base commit, as a text diff (see the module docstring). `changed`: the paths
    the sandbox changed since its staging, where it knows them (a fork's overlay, `changed_paths`): git then looks
    at those alone, on a fresh index of the base, instead of walking the whole tree (a fork's first walk re-reads
    the files whose stat data no longer matches the index's), and nothing changed is no patch, no command run. A
    patch whose base64 fits in a command's output (`max_output_bytes`) comes back on that output: reading it back
    costs a fork another process start in its namespaces (~50 ms), as much as the extraction itself."""
    paths = _paths_to_diff(changed)
    if paths == []:
        return ExtractedPatch(patch="")
    inline = max(0, (max_output_bytes - len(_INLINE) - 2) * 3 // 4)
    argv = ["bash", "-c", _EXTRACT, "prorl", workdir, base_commit, str(inline), *(paths or [])]
    result = await sandbox.exec(argv, timeout=timeout_s)
    if result.exit_code != 0:
        why = "timed out" if result.timed_out else result.output.strip()[-1000:] or f"exit {result.exit_code}"
        return ExtractedPatch(patch="", notes=[f"no patch could be extracted: {why}"])
    marker, _, encoded = result.output.partition("\n")
    if marker == _INLINE and not result.truncated:
        raw = base64.b64decode(encoded)
    else:
        raw = await sandbox.read_file(_PATCH_OUT)
    return clean_patch(raw.decode(errors="replace"), max_bytes)


_GIT_STATE = (".git/index", ".git/HEAD", ".git/ORIG_HEAD", ".git/COMMIT_EDITMSG")
_GIT_STATE_DIRS = (".git/objects/", ".git/refs/", ".git/logs/")  # what git's own commands write: no patch changes
_GIT_RULES = (".gitignore", ".gitattributes")
_MAX_PATHS_BYTES = 32_000  # the exec request travels as one argument (at most 128 KiB), hex-encoded


def _paths_to_diff(changed: list[str] | None) -> list[str] | None:
    """The paths of `changed` that can make a patch ([]: none), leaving out git's own state, the python tool's and
    an earlier extraction's output; None (walk the whole tree) for unknown changes, too many to pass, or a change to
    what git ignores or how it diffs (a .gitignore or .gitattributes, .git's config or info, the user's git config
    in HOME, the workspace): it may concern files no fork touched."""
    if changed is None:
        return None
    paths = []
    for path in changed:
        if path in (_PATCH_OUT, _TOOL_STATE, *_GIT_STATE) or path.startswith((f"{_TOOL_STATE}/", *_GIT_STATE_DIRS)):
            continue
        top, name = path.split("/", 1)[0], path.rsplit("/", 1)[-1]
        if top in (".git", ".gitconfig", ".config") or name in _GIT_RULES:
            return None
        paths.append(path)
    return paths if sum(len(p.encode()) + 1 for p in paths) <= _MAX_PATHS_BYTES else None


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


_IMAGE_TREE = f"""set -euo pipefail
[ -d "$1" ] || {{ echo "the image has no $1 (no repository in it, and the row has no repo_source)" >&2; exit 3; }}
tar -C "$1" --exclude=./.git -cf {_STAGE_TAR} .
"""


async def image_tree(backend: str, image: str | None, repo_dir: str, timeout_s: float) -> bytes:
    """The tree the image holds at `repo_dir` (without .git) as a tar, taken out once per image (a sandbox whose
    workspace is elsewhere reads it) and kept in ``swe_repo``'s cache: staging mounts the workspace over it."""
    key = hashlib.sha256(f"{backend}\0{image}\0{_mtime(image)}\0{repo_dir}".encode()).hexdigest()[:24]
    cached = swe_repo.cache_dir() / "images" / f"{key}.tar"
    if cached.is_file():
        return await asyncio.to_thread(cached.read_bytes)
    spec = SandboxSpec(image=image, limits=SandboxLimits(max_read_mb=4096, disk_mb=None, wall_clock_s=timeout_s + 60))
    async with open_sandbox(backend, spec) as sandbox:
        result = await sandbox.exec(["bash", "-c", _IMAGE_TREE, "prorl", repo_dir], timeout=timeout_s)
        if result.exit_code != 0:
            raise StagingError(f"taking {repo_dir} out of image {image} failed: {result.output.strip()[-2000:]}")
        tree = await sandbox.read_file(_STAGE_TAR)
    await asyncio.to_thread(swe_repo.write_atomic, cached, tree)
    return tree


def _mtime(image: str | None) -> int:
    return os.stat(image).st_mtime_ns if image is not None and Path(image).exists() else 0
