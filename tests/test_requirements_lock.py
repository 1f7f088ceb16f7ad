"""The venv the bootstrap made holds requirements.lock's set: the versions CI tests are the versions a user gets."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

LOCK = Path(__file__).resolve().parents[1] / "requirements.lock"
SETUP_CFG = LOCK.with_name("setup.cfg")


def _pins() -> dict[str, str]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    return pins


def test_the_installed_set_is_the_lock() -> None:
    installed = {canonicalize_name(d.metadata["Name"]): d.version.split("+")[0] for d in metadata.distributions()}
    differ = {name: (pin, installed.get(name)) for name, pin in _pins().items() if installed.get(name) != pin}
    assert not differ, f"installed versions differ from requirements.lock (pin, installed): {differ}"


def test_the_lock_pins_every_requirement_of_the_package() -> None:
    """A dependency added to setup.cfg without `scripts/lock.sh` would install unpinned, untested."""
    text = SETUP_CFG.read_text()
    block = re.findall(r"^(?:install_requires|test|train) =\n((?:[ \t]+\S.*\n)+)", text, re.MULTILINE)
    names = {
        canonicalize_name(Requirement(line.strip()).name)
        for lines in block for line in lines.splitlines() if line.strip() and not line.strip().startswith("#")
    }  # fmt: skip
    unpinned = names - set(_pins()) - {"llama-cpp-python"}  # the bootstrap builds that one
    assert not unpinned, f"requirements.lock lacks {sorted(unpinned)}: run scripts/lock.sh"
