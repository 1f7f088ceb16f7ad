"""`gym env test` passes for our code and stem resources servers (nemo_gym_prorl/gym/task_server.py behind thin
configs), run by Gym's own CLI from our plugin root over the real sandbox."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_gym_prorl.gym.processes import gym_environ, run_gym

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("server", ["prorl_code", "prorl_stem"])
async def test_gym_env_test_passes(server: str, tmp_path: Path) -> None:
    out = await run_gym(
        ["env", "test", "--resources-server", server, f"hydra.run.dir={tmp_path / 'hydra'}"],
        gym_environ(), REPO_ROOT, timeout_s=300,
    )
    assert " passed" in out and " failed" not in out and "uv: command not found" not in out, out[-3000:]
