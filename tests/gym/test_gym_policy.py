"""The training policy's servers read from Gym's global config as NeMo RL writes it, and registered exactly once."""

from __future__ import annotations

import asyncio

import pytest
from omegaconf import OmegaConf

from nemo_gym_prorl.gym.policy import PolicyBackends, PolicyRegistration, policy_backends


def test_policy_servers_come_from_the_global_config_nemo_rl_writes() -> None:
    config = OmegaConf.create(
        {
            "policy_base_url": ["http://10.0.0.1:5001/v1", "http://10.0.0.2:5001/v1"],  # one per vLLM DP rank
            "policy_model_name": "Qwen/Qwen3-1.7B",
            "policy_api_key": "dummy_key",
        }
    )
    backends = policy_backends(config, replace=False)
    assert backends == PolicyBackends(
        addresses=["http://10.0.0.1:5001/v1", "http://10.0.0.2:5001/v1"],
        model="Qwen/Qwen3-1.7B",
        api_key="dummy_key",
        replace=False,
    )
    one = policy_backends({"policy_base_url": "http://h:8000/v1", "policy_model_name": "m"})
    assert one is not None and one.addresses == ["http://h:8000/v1"] and one.api_key is None and one.replace
    assert policy_backends(OmegaConf.create({"head_server": {"port": 1}})) is None  # a Gym run without a trainer
    with pytest.raises(ValueError, match="policy_model_name"):
        policy_backends({"policy_base_url": ["http://h:8000/v1"]})


async def test_concurrent_first_runs_register_once_and_a_failed_registration_is_tried_again() -> None:
    calls: list[PolicyBackends] = []
    failures = [RuntimeError("the service is not up yet")]

    async def register(backends: PolicyBackends) -> None:
        await asyncio.sleep(0)  # others arrive while the first registers
        calls.append(backends)
        if failures:
            raise failures.pop()

    registration = PolicyRegistration(PolicyBackends(addresses=["http://h:1/v1"], model="m"), register)
    with pytest.raises(RuntimeError, match="not up yet"):
        await registration.ensure()
    assert not registration.registered
    await asyncio.gather(*(registration.ensure() for _ in range(8)))
    assert registration.registered and len(calls) == 2
    await registration.ensure()
    assert len(calls) == 2
    nothing = PolicyRegistration(None, register)
    await nothing.ensure()
    assert nothing.registered and len(calls) == 2
