"""Where the `apptainer` binary is: the one the install script put in the repo, a configured one, or PATH's."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from nemo_gym_prorl.contracts.sandbox import SandboxError

APPTAINER_ENV = "PRORL_APPTAINER"
PREFIX_ENV = "PRORL_APPTAINER_PREFIX"
INSTALL_SCRIPT = "scripts/install_apptainer.sh"
_REPO = Path(__file__).resolve().parents[2]


def find_apptainer() -> str:
    """The `apptainer` binary: `$PRORL_APPTAINER`, else the prefix the install script uses
    (`$PRORL_APPTAINER_PREFIX`, by default the repo's `.apptainer`), else PATH."""
    configured = os.environ.get(APPTAINER_ENV)
    if configured:
        if not os.access(configured, os.X_OK):
            raise SandboxError(f"${APPTAINER_ENV}={configured} is not an executable")
        return configured
    prefix = os.environ.get(PREFIX_ENV) or _REPO / ".apptainer"
    private = Path(prefix) / "usr" / "bin" / "apptainer"
    if os.access(private, os.X_OK):
        return str(private)
    found = shutil.which("apptainer")
    if found:
        return found
    raise SandboxError(f"apptainer is not installed: run {_REPO / INSTALL_SCRIPT} (or set ${APPTAINER_ENV})")
