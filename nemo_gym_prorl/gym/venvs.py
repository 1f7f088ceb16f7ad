"""Venvs for Gym's offline start: `<venvs dir>/<server type>/<server name>/.venv` links to the venv running us.

Gym gives each server its own uv venv, built from the network. With `skip_venv_if_present` (env.yaml) it uses one
that already exists at that path instead, so links to our venv — which has nemo-gym and this package — let every
server of our configs start offline.

    python -m nemo_gym_prorl.gym.venvs        # what scripts/bootstrap.sh runs
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
VENVS_DIR_ENV = "PRORL_GYM_VENVS"
DEFAULT_VENVS_DIR = ".venv/gym-venvs"  # relative to the repo root, as in env.yaml

# Every server our configs start: ours and the Gym servers they wire it to.
SERVERS = (
    "resources_servers/prorl_math",
    "resources_servers/prorl_code",
    "resources_servers/prorl_stem",
    "resources_servers/prorl_swe",
    "resources_servers/prorl_bench",
    "responses_api_agents/prorl_service",
    "responses_api_agents/prorl_agent",
    "responses_api_agents/simple_agent",
    "responses_api_models/vllm_model",
    "environment_servers/legacy_agent",
    "environment_servers/single_agent_turn_legacy",
)


def venvs_dir() -> Path:
    """The `uv_venv_dir` env.yaml gives Gym when gym runs from the repo root."""
    return Path(os.environ.get(VENVS_DIR_ENV) or REPO_ROOT / DEFAULT_VENVS_DIR).absolute()


def ensure_venv_links(root: Path | None = None, venv: Path | None = None) -> list[Path]:
    """Point `<root>/<server>/.venv` at `venv` (default: the running one) for every server; returns the links."""
    root = root or venvs_dir()
    target = (venv or Path(sys.prefix)).resolve()
    links = []
    for server in SERVERS:
        link = root / server / ".venv"
        link.parent.mkdir(parents=True, exist_ok=True)
        if not (link.is_symlink() and Path(os.readlink(link)) == target):
            if link.is_symlink() or link.exists():
                link.unlink()  # a stale link (a directory here would be someone's real venv: unlink refuses it)
            link.symlink_to(target, target_is_directory=True)
        links.append(link)
    return links


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Link the venvs Gym uses for our servers to this venv.")
    parser.add_argument("--venvs-dir", type=Path, help=f"default: ${VENVS_DIR_ENV}, else {DEFAULT_VENVS_DIR}")
    args = parser.parse_args(argv)
    links = ensure_venv_links(args.venvs_dir)
    print(f"gym venvs: {len(links)} links under {links[0].parents[2]} -> {Path(sys.prefix).resolve()}")


if __name__ == "__main__":
    main()
