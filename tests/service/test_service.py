"""The rollout service over real HTTP: jobs, streams, ProRL endpoints, Gym's /run, deadlines, cancel, bad input.

The model is the deterministic stand-in server (a real process speaking the real protocol, with scripted replies);
sandboxes are real bubblewrap sandboxes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from pathlib import Path

import httpx
import psutil
import pytest
from nemo_gym.base_resources_server import BaseVerifyResponse
from sandbox_helpers import sandbox_dirs_of, sandboxes_left
from service_helpers import service, service_config
from standin_helpers import ROW, SCRIPT

from nemo_gym_prorl.agent.llm_pool import LLMPoolConfig
from nemo_gym_prorl.contracts.job import Deadlines, JobRequest
from nemo_gym_prorl.contracts.trajectory import Trajectory, contiguity_violation
from nemo_gym_prorl.launch.serve import run_service
from nemo_gym_prorl.models.launcher import ModelServerProcess
from nemo_gym_prorl.models.local_model import default_gguf
from nemo_gym_prorl.models.standin import standin_argv
from nemo_gym_prorl.models.tokenizer import Tokenizer
from nemo_gym_prorl.service.client import RolloutClient, ServiceError
from nemo_gym_prorl.service.pipeline import PipelineConfig, StageConfig
from nemo_gym_prorl.service.store import JobStore


def processes_running(argv: list[str]) -> list[psutil.Process]:
    """Our descendants whose command line is `argv`."""
    found = []
    for process in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if process.cmdline() == argv:
                found.append(process)
    return found


async def test_a_job_streams_each_sample_and_is_kept(instant_model: str, tmp_path: Path) -> None:
    async with service(instant_model, tmp_path) as svc, RolloutClient(svc.url) as client:
        job_id = await client.submit(JobRequest(instance=ROW, n=3, sampling_params={"seed": 1}))
        streamed = [item async for item in client.stream(job_id)]
        assert sorted(sample for sample, _ in streamed) == [0, 1, 2]
        view = await client.get(job_id)
        status = await client.get(job_id, results=False)  # for polling: state and counts, no trajectories
        waited = await client.wait(job_id)
    assert (status.state, status.finished, status.results) == ("done", 3, [])
    assert waited == view  # results from the stream, in sample order, as GET returns them
    assert view.state == "done" and view.finished == 3
    for trajectory in view.results:
        assert trajectory.reward == 1.0 and trajectory.critical_error is None and trajectory.num_tool_calls == 1
        assert "42" in trajectory.messages[-2]["content"]  # the bash tool really ran in the sandbox
        assert contiguity_violation(trajectory.assistant_turns()) is None
        assert trajectory.timing.init > 0 and trajectory.timing.eval > 0
    assert sandboxes_left() == []


async def test_prorl_endpoints(instant_model: str, tmp_path: Path) -> None:
    async with service(instant_model, tmp_path) as svc, httpx.AsyncClient(base_url=svc.url, timeout=60) as http:
        result = (await http.post("/process", json={"instance": ROW, "sampling_params": {"temperature": 1.0}})).json()
        assert Trajectory.model_validate(result).reward == 1.0
        status = (await http.get("/status")).json()
        assert status["stages"]["init"]["queued"] == 0 and status["llm_backends"][0]["in_flight"] == 0
        assert (await http.post("/stop")).json()["paused"] is True
        assert (await http.post("/start")).json()["paused"] is False
        added = (await http.post("/add_llm_server", json={"address": "127.0.0.1:1"})).json()
        assert len(added["backends"]) == 2
        policy = {"addresses": ["127.0.0.1:2", "http://127.0.0.1:3/v1"], "model": "policy", "api_key": "s3cret-key"}
        policy["replace"] = True
        replaced = (await http.post("/add_llm_server", json=policy)).json()  # a trainer's policy servers, alone
        assert [(b["address"], b["model"]) for b in replaced["backends"]] == [
            ("http://127.0.0.1:2/v1", "policy"), ("http://127.0.0.1:3/v1", "policy")
        ] and "s3cret-key" not in str(replaced)  # fmt: skip
        bad = await http.post("/add_llm_server", json={"addresses": ["127.0.0.1:4", "ftp://x"], "replace": True})
        assert bad.status_code == 422 and bad.json()["error"]["field"] == "addresses"
        assert len((await http.get("/status")).json()["llm_backends"]) == 2  # checked before anything changed
        for address in ("not a url", "http://", "gpu node:8000"):  # registered as healthy, before
            bad = await http.post("/add_llm_server", json={"address": address})
            assert bad.status_code == 422 and bad.json()["error"]["field"] == "address", bad.text
        assert len((await http.get("/status")).json()["llm_backends"]) == 2
        for route in ("/process", "/jobs", "/add_llm_server"):  # a body that is no JSON is a bad request, not a field
            bad = await http.post(route, content=b'{"instance": {', headers={"content-type": "application/json"})
            assert bad.status_code == 400 and bad.json()["error"]["message"].startswith("malformed JSON body"), bad.text
        assert (await http.post("/add_llm_server", json={"model": "m"})).status_code == 422
        assert (await http.post("/clear_llm_server")).json() == {"backends": []}
        assert (await http.post("/cancel", json={"job_id": "nope"})).status_code == 404
        metrics = (await http.get("/metrics")).text
        assert 'prorl_rollouts_finished_total{outcome="ok"} 1.0' in metrics
        assert "/jobs" in (await http.get("/openapi.json")).json()["paths"]


async def test_gym_run_returns_a_verify_response_nemo_rl_can_train_on(instant_model: str, tmp_path: Path) -> None:
    row = {
        "responses_create_params": {"input": [{"role": "user", "content": ROW["question"]}], "temperature": 1.0, "top_p": 1.0, "max_output_tokens": 64},
        **ROW,
        "_rowidx": 7,
        "_ng_task_index": 3,
        "instance_config": {"seed": 3},  # a row's own, kept beside the mask
        "agent_ref": {"type": "responses_api_agents", "name": "prorl_service_agent"},  # as `prorl data export`
        "task_source": "prorl_service_agent",
    }
    async with service(instant_model, tmp_path) as svc, httpx.AsyncClient(base_url=svc.url, timeout=60) as http:
        first = (await http.post("/run", json=row)).json()
        again = await http.post("/run", json=row)
    assert again.status_code == 200
    verified = BaseVerifyResponse.model_validate(first)
    assert verified.reward == 1.0 and not verified.mask_sample and first["_rowidx"] == 7
    assert first["instance_config"] == {"seed": 3, "mask_sample": False}  # where NeMo RL reads the mask
    # top-level numbers, each one a NeMo RL metric
    assert (first["num_turns"], first["num_tool_calls"], first["num_format_errors"]) == (2, 1, 0)
    assert first["run_time_s"] > 0 and first["init_time_s"] > 0 and first["eval_time_s"] > 0
    items = first["response"]["output"]
    assert [item["type"] for item in items] == ["message", "function_call", "function_call_output", "message"]
    trained = [item for item in items if "generation_token_ids" in item]
    assert len(trained) == 2 and contiguity_violation(trained) is None
    assert "42" in items[2]["output"]


async def test_cancel_during_run_frees_the_sandbox(slow_model: str, tmp_path: Path) -> None:
    async with service(slow_model, tmp_path) as svc, RolloutClient(svc.url) as client:
        job_id = await client.submit(JobRequest(instance=ROW, n=2))
        async with asyncio.timeout(60):
            while svc.orchestrator.pipeline.status()["run"]["active"] < 2:
                await asyncio.sleep(0.05)
        assert sandboxes_left()
        view = await client.cancel(job_id)
        assert sandboxes_left() == []
        assert view.state == "cancelled" and view.finished == 2
        assert {t.critical_error for t in view.results} == {"cancelled"}


async def test_stage_deadline_ends_the_rollout_as_timeout(slow_model: str, tmp_path: Path) -> None:
    async with service(slow_model, tmp_path) as svc, RolloutClient(svc.url) as client:
        job_id = await client.submit(JobRequest(instance=ROW, deadlines={"run_s": 1.0}))
        view = await client.wait(job_id)
    (trajectory,) = view.results
    assert trajectory.critical_error == "timeout" and "run stage ran past its deadline of 1 s" in trajectory.error
    assert trajectory.timing.run < 10 and sandboxes_left() == []


async def test_a_sandbox_killed_mid_run_ends_the_rollout_as_a_run_failure(tmp_path: Path) -> None:
    script = ["```bash\nsleep 600\n```", "\\boxed{42}"]
    async with ModelServerProcess(standin_argv(script)) as model, service(model.base_url, tmp_path) as svc:
        async with RolloutClient(svc.url) as client:
            job_id = await client.submit(JobRequest(instance=ROW))
            async with asyncio.timeout(60):  # the model's command runs in the sandbox
                while not (sleeping := processes_running(["sleep", "600"])):
                    await asyncio.sleep(0.05)
            sleeping[0].parent().kill()  # the sandbox's shell, init of its pid namespace: SIGKILL from the host
            view = await client.wait(job_id)
    (trajectory,) = view.results
    assert trajectory.critical_error == "run" and "the sandbox was killed" in trajectory.error
    assert trajectory.finish == "error" and trajectory.reward == 0.0
    assert sandboxes_left() == [] and sandbox_dirs_of(os.getpid()) == []


@pytest.mark.parametrize(
    ("body", "status", "field"),
    [
        ({"instance": ROW, "task": "chess"}, 422, "task"),
        ({"instance": ROW, "n": -1}, 422, "n"),
        ({"instance": ROW, "n": 10**6}, 422, "n"),
        ({"instance": {"id": "x"}}, 422, "instance"),
        ({"instance": {"id": "x", "question": "Calculate 1 + 1."}}, 422, "verifier.answer_key"),  # graded on it
        ({"instance": ROW, "sampling_params": {"temperature": "hot"}}, 422, "sampling_params.temperature"),
        ({"instance": ROW, "surprise": 1}, 422, "surprise"),
        ({"instance": ROW, "job_id": "no spaces allowed"}, 422, "job_id"),
    ],
)
async def test_bad_jobs_are_refused_naming_the_field(instant_model: str, tmp_path: Path, body, status, field) -> None:
    async with service(instant_model, tmp_path) as svc, httpx.AsyncClient(base_url=svc.url) as http:
        response = await http.post("/jobs", json=body)
        assert response.status_code == status
        assert field in response.json()["error"]["message"]
        assert (await http.get("/health")).status_code == 200


async def test_malformed_oversized_duplicate_and_unauthorized_requests(instant_model: str, tmp_path: Path) -> None:
    async with service(instant_model, tmp_path, token="s3cret", max_body_bytes=4096) as svc:
        async with httpx.AsyncClient(base_url=svc.url, headers={"authorization": "Bearer s3cret"}) as http:
            bad_json = await http.post("/jobs", content=b"{not json", headers={"content-type": "application/json"})
            assert bad_json.status_code == 400 and "malformed JSON body at byte 1" in bad_json.json()["error"]["message"]
            huge = await http.post("/jobs", json={"instance": {"question": "x" * 10_000}})
            assert huge.status_code == 413
            assert (await http.post("/jobs", json={"instance": ROW, "job_id": "j1"})).status_code == 202
            duplicate = await http.post("/jobs", json={"instance": ROW, "job_id": "j1"})
            assert duplicate.status_code == 409 and "j1" in duplicate.json()["error"]["message"]
        async with RolloutClient(svc.url, token="wrong") as client:
            with pytest.raises(ServiceError) as refused:
                await client.submit(JobRequest(instance=ROW))
            assert refused.value.status == 401


async def test_results_survive_a_restart_and_unfinished_jobs_are_requeued(instant_model: str, slow_model: str, tmp_path: Path) -> None:
    async with service(instant_model, tmp_path) as svc, RolloutClient(svc.url) as client:
        finished = await client.submit(JobRequest(instance=ROW, job_id="finished"))
        await client.wait(finished)
    async with service(slow_model, tmp_path) as svc, RolloutClient(svc.url) as client:
        await client.submit(JobRequest(instance=ROW, job_id="in-flight"))
    # the service stopped with "in-flight" running: a new one (on the fast model) finishes it
    async with service(instant_model, tmp_path) as svc, RolloutClient(svc.url) as client:
        assert (await client.get("finished")).results[0].reward == 1.0
        view = await client.wait("in-flight")
    assert view.state == "done" and view.results[0].reward == 1.0


async def test_a_restart_settles_every_job_the_store_holds_even_one_that_no_longer_fits(
    instant_model: str, tmp_path: Path
) -> None:
    """What a SIGKILL can leave in the store, and a task edited in between: none of it keeps the service down."""
    def job(job_id: str, instance: dict, n: int, state: str, recorded: list[int]) -> None:
        request = JobRequest(instance=instance, n=n, job_id=job_id)
        store.add_job(job_id, request.model_dump(mode="json"), n)
        store.set_state(job_id, state)
        for sample in recorded:
            store.add_result(job_id, sample, Trajectory(instance_id="q1", trajectory_id=f"{job_id}:{sample}", reward=1.0))

    store = JobStore(tmp_path / "service.db")
    try:
        job("misfit", {"id": "q9", "prompt": "the row of an older task version"}, 2, "running", [])
        job("all-recorded", ROW, 2, "running", [0, 1])  # killed before it was marked done
        job("cancelled", ROW, 2, "cancelled", [0])  # killed before the cancel reached sample 1
        job("in-flight", ROW, 1, "running", [])
    finally:
        store.close()

    async with service(instant_model, tmp_path) as svc, RolloutClient(svc.url) as client:
        misfit, recorded, cancelled = [await client.get(j) for j in ("misfit", "all-recorded", "cancelled")]
        in_flight = await client.wait("in-flight")

    assert misfit.state == "done" and [t.critical_error for t in misfit.results] == ["cancelled"] * 2
    assert "cannot run here now" in misfit.results[0].error and "question" in misfit.results[0].error
    assert (recorded.state, [t.reward for t in recorded.results]) == ("done", [1.0, 1.0])
    assert cancelled.state == "cancelled" and [t.critical_error for t in cancelled.results] == [None, "cancelled"]
    assert in_flight.state == "done" and in_flight.results[0].reward == 1.0


async def test_a_stop_cuts_open_streams_and_blocking_calls_instead_of_waiting_for_their_rollouts(
    slow_model: str, tmp_path: Path
) -> None:
    async with asyncio.timeout(300), contextlib.AsyncExitStack() as clients:  # a guard: the old stop waited 60 s
        async with service(slow_model, tmp_path, shutdown_grace_s=0.5) as svc:
            client = await clients.enter_async_context(RolloutClient(svc.url))
            job_id = await client.submit(JobRequest(instance=ROW, job_id="streamed"))
            streamed = asyncio.create_task(client.wait(job_id))
            blocking = asyncio.create_task(client.process(ROW | {"id": "q2"}))
            async with asyncio.timeout(60):
                while svc.orchestrator.pipeline.status()["run"]["active"] < 2:
                    await asyncio.sleep(0.05)
        for cut in (streamed, blocking):  # each caller hears that the service went away
            with pytest.raises((httpx.HTTPError, ServiceError)):
                await cut
    store = JobStore(tmp_path / "service.db")
    try:  # the rollouts were stopped, not waited for: their jobs are in flight for the next start to requeue
        assert store.progress("streamed").finished == 0 and store.progress("streamed").state == "running"
    finally:
        store.close()


async def test_a_weight_sync_counts_as_queue_time_not_against_the_deadlines(instant_model: str, tmp_path: Path) -> None:
    sync_s = 4.0
    async with service(instant_model, tmp_path) as svc, RolloutClient(svc.url) as client:
        await client.pause_llm()  # the trainer starts syncing weights
        job = await client.submit(JobRequest(instance=ROW, deadlines=Deadlines(run_s=3.0, total_s=3.5)))
        async with asyncio.timeout(60):
            while svc.orchestrator.pool.waiting < 1:  # the rollout's first turn waits for the sync
                await asyncio.sleep(0.02)
        await asyncio.sleep(sync_s)  # the sync itself, longer than both deadlines
        await client.resume_llm()
        [trajectory] = (await client.wait(job)).results
    assert trajectory.critical_error is None, trajectory.error
    assert trajectory.reward == 1.0 and trajectory.timing.queued >= sync_s


async def test_a_weight_update_between_turns_loses_nothing_and_each_turn_carries_its_version(tmp_path: Path) -> None:
    """A trainer's update while a two-turn rollout is at the model: the turn in flight finishes on the old weights
    (pause never aborts it), the next waits and is generated by the new ones, and the trajectory says both."""
    async with ModelServerProcess(standin_argv(SCRIPT, latency_s=1.0)) as model:
        async with run_service(service_config(model.base_url, tmp_path)) as svc, RolloutClient(svc.url) as client:
            await client.resume_llm(policy_version=0)
            job_id = await client.submit(JobRequest(instance=ROW, n=2))
            async with asyncio.timeout(60):  # both first turns are at the model
                while svc.orchestrator.pool.in_flight < 2:
                    await asyncio.sleep(0.02)
            await client.pause_llm()  # returns once both have answered
            assert (await client.status())["policy_version"] == 0
            await client.resume_llm(policy_version=1)
            assert (await client.status())["policy_version"] == 1
            view = await client.wait(job_id)
            generated = svc.orchestrator.pool.generated
    assert [t.critical_error for t in view.results] == [None, None] and [t.reward for t in view.results] == [1.0, 1.0]
    # every token the model generated is in a trajectory: the update cut nothing
    kept = [turn["generation_token_ids"] for t in view.results for turn in t.assistant_turns()]
    assert (generated.answers, generated.completion_tokens) == (len(kept), sum(map(len, kept)))
    for trajectory in view.results:
        assert [turn["policy_version"] for turn in trajectory.assistant_turns()] == [0, 1]
        assert (trajectory.first_policy_version, trajectory.last_policy_version) == (0, 1)
        assert contiguity_violation(trajectory.assistant_turns()) is None


async def test_a_weight_update_in_cut_mode_cuts_the_turns_in_flight_and_re_issues_them_losing_no_token(
    tmp_path: Path,
) -> None:
    """weight_update=cut: the pause aborts both first turns at the model mid-stream (it returns with their
    generations unfinished), each is re-issued after the resume as prompt + its partial ids against the new weights,
    and the turn is exactly the model's reply, its tokens' versions in spans; nothing is lost."""
    tokenizer = Tokenizer.from_gguf(default_gguf())
    reply = tokenizer.encode(SCRIPT[0]) + [tokenizer.eos_token_id]
    settings = {"llm_pool": LLMPoolConfig(weight_update="cut")}
    async with ModelServerProcess(standin_argv(SCRIPT, latency_s=3.0)) as model, httpx.AsyncClient() as http:
        async with run_service(service_config(model.base_url, tmp_path, **settings)) as svc, RolloutClient(svc.url) as client:
            await client.resume_llm(policy_version=0)
            job_id = await client.submit(JobRequest(instance=ROW, n=2))
            pool = svc.orchestrator.pool
            async with asyncio.timeout(60):  # both first turns have streamed some tokens
                while len(pool._streams) < 2 or not all(p.ids for p in pool._streams.values()):
                    await asyncio.sleep(0.02)
            partials = list(pool._streams.values())
            await client.pause_llm()
            # it returned with both generations unfinished: cut, not waited for
            assert pool.in_flight == 0 and all(not p.done and 0 < len(p.ids) < len(reply) for p in partials)
            await client.resume_llm(policy_version=1)
            view = await client.wait(job_id)
            status = await client.status()
            stats = (await http.get(model.base_url.removesuffix("/v1") + "/control/stats")).json()
    assert stats["aborted"] == 2  # the model's generations were aborted, not left running
    assert [t.critical_error for t in view.results] == [None, None] and [t.reward for t in view.results] == [1.0, 1.0]
    assert status["generated"]["cut"] == 2
    assert (status["generated"]["lost_requests"], status["generated"]["lost_tokens"]) == (0, 0)
    kept = [turn["generation_token_ids"] for t in view.results for turn in t.assistant_turns()]
    assert status["generated"]["completion_tokens"] == sum(map(len, kept))
    for trajectory in view.results:
        first, second = trajectory.assistant_turns()
        assert first["generation_token_ids"] == reply  # the model's own tokens, none twice or missing
        assert len(first["generation_log_probs"]) == len(first["generation_token_ids"])
        [(v0, n0), (v1, n1)] = first["version_spans"]
        assert (v0, v1) == (0, 1) and n0 > 0 and n1 > 0 and n0 + n1 == len(first["generation_token_ids"])
        assert first["policy_version"] == 0 and second["policy_version"] == 1 and "version_spans" not in second
        assert (trajectory.first_policy_version, trajectory.last_policy_version) == (0, 1)
        assert contiguity_violation(trajectory.assistant_turns()) is None
        assert Trajectory.model_validate_json(trajectory.model_dump_json()).assistant_turns() == [first, second]


@pytest.mark.parametrize("on_stale", ["mask", "rerun"])
async def test_a_rollout_spanning_more_updates_than_allowed_is_masked_or_run_again(
    tmp_path: Path, on_stale: str
) -> None:
    """max_version_lag=0 and a weight update between the two turns: masked, it comes back saying why; rerun, it
    runs again from its start on the new weights and comes back whole, every turn of version 1."""
    async with ModelServerProcess(standin_argv(SCRIPT, latency_s=1.0)) as model:
        async with run_service(service_config(model.base_url, tmp_path)) as svc, RolloutClient(svc.url) as client:
            await client.resume_llm(policy_version=0)
            job_id = await client.submit(JobRequest(instance=ROW, max_version_lag=0, on_stale=on_stale))
            async with asyncio.timeout(60):  # the first turn is at the model
                while svc.orchestrator.pool.in_flight < 1:
                    await asyncio.sleep(0.02)
            await client.pause_llm()
            await client.resume_llm(policy_version=1)
            [trajectory] = (await client.wait(job_id)).results
            assert (await client.status())["stale_rollouts"] == 1
    versions = [turn["policy_version"] for turn in trajectory.assistant_turns()]
    if on_stale == "mask":
        assert versions == [0, 1]
        assert trajectory.stale == "its turns span policy versions 0 to 1, more than max_version_lag=0"
        assert trajectory.mask_reason() == f"stale: {trajectory.stale}"
    else:
        assert versions == [1, 1] and trajectory.stale is None and trajectory.mask_reason() is None
        assert trajectory.reward == 1.0


async def test_a_group_stops_early_once_enough_samples_are_usable(tmp_path: Path) -> None:
    """n=4 with stop_at_usable=2, two at a time in the run stage: the first two end usable, the two behind them are
    cancelled at once (not run to the end) and come back as cancelled, saying why; no sandbox is left."""
    pipeline = PipelineConfig(run=StageConfig(workers=2, deadline_s=600))
    async with ModelServerProcess(standin_argv(SCRIPT, latency_s=2.0)) as model:
        config = service_config(model.base_url, tmp_path, pipeline=pipeline)
        async with run_service(config) as svc, RolloutClient(svc.url) as client:
            job_id = await client.submit(JobRequest(instance=ROW, n=4, stop_at_usable=2))
            view = await client.wait(job_id)
            served = svc.orchestrator.pool.generated.answers
    usable = [t for t in view.results if t.mask_reason() is None]
    cancelled = [t for t in view.results if t.critical_error == "cancelled"]
    counts = (view.state, view.finished, len(usable), len(cancelled))
    assert counts == ("done", 4, 2, 2), [t.error for t in view.results]
    assert all(t.reward == 1.0 for t in usable)
    assert all(t.error.startswith("early stop: 2 of the group's samples were usable") for t in cancelled)
    assert served < 4 * len(SCRIPT)  # the stragglers did not run their turns out
    assert sandboxes_left() == []


async def test_early_stop_asks_for_no_more_than_the_group(instant_model: str, tmp_path: Path) -> None:
    async with service(instant_model, tmp_path) as svc, httpx.AsyncClient(base_url=svc.url) as http:
        response = await http.post("/jobs", json={"instance": ROW, "n": 2, "stop_at_usable": 3})
    assert response.status_code == 422 and "stop_at_usable must be at most n (2), got 3" in response.text


TRAINER = """
import json, os, sys
from nemo_gym_prorl.service.client import SyncRolloutClient
url, job_id, taken, stop_after = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
with SyncRolloutClient(url) as client:
    for count, (sample, trajectory) in enumerate(client.stream(job_id, consumer="trainer"), 1):
        with open(taken, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "sample": sample, "reward": trajectory.reward}) + "\\n")
        client.acknowledge(job_id, "trainer", [sample])
        if count == stop_after:
            os.kill(os.getpid(), 9)  # the trainer dies mid-job: no cleanup, no goodbye
"""


async def test_a_trainer_killed_and_restarted_gets_every_result_exactly_once(tmp_path: Path) -> None:
    """A stand-in trainer process takes two results of a job of four, acknowledging each, and is SIGKILLed; the
    rollouts go on; the restarted trainer, with the same consumer name and job id, gets the other two, none again.
    Another consumer still gets all four."""
    taken = tmp_path / "taken.jsonl"
    async with ModelServerProcess(standin_argv(SCRIPT, latency_s=0.5)) as model:
        pipeline = PipelineConfig(run=StageConfig(workers=1, deadline_s=600))  # one at a time: the kill is mid-job
        config = service_config(model.base_url, tmp_path, pipeline=pipeline)
        async with run_service(config) as svc, RolloutClient(svc.url) as client:
            job_id = await client.submit(JobRequest(instance=ROW, n=4))
            for stop_after, exit_code in ((2, -9), (0, 0)):  # killed after two; the restart runs to the end
                trainer = await asyncio.create_subprocess_exec(
                    sys.executable, "-c", TRAINER, svc.url, job_id, str(taken), str(stop_after)
                )
                assert await asyncio.wait_for(trainer.wait(), 120) == exit_code
            everything = [sample async for sample, _ in client.stream(job_id, consumer="evaluator")]
            with pytest.raises(ServiceError, match="have no result"):
                await client.acknowledge(job_id, "trainer", [7])
    lines = [json.loads(line) for line in taken.read_text().splitlines()]
    first, second = sorted({line["pid"] for line in lines}, key=[line["pid"] for line in lines].index)
    assert len([x for x in lines if x["pid"] == first]) == 2
    assert sorted(line["sample"] for line in lines) == [0, 1, 2, 3]  # each once, across the two trainers
    assert all(line["reward"] == 1.0 for line in lines)
    assert sorted(everything) == [0, 1, 2, 3]


async def test_a_model_backend_killed_mid_rollout_is_retried_on_another(tmp_path: Path) -> None:
    from nemo_gym_prorl.agent.llm_pool import LLMPoolConfig

    script = ["```bash\necho $((6 * 7))\n```", "\\boxed{42}"]
    async with ModelServerProcess(standin_argv(script, hold=True)) as doomed, ModelServerProcess(standin_argv(script)) as healthy:
        pool = LLMPoolConfig(backoff_base_s=0.05, health_interval_s=0)
        config = service_config(doomed.base_url, tmp_path, llm_pool=pool)
        async with run_service(config) as svc, RolloutClient(svc.url) as client:
            job_id = await client.submit(JobRequest(instance=ROW, n=3))
            async with asyncio.timeout(60):  # all three are waiting on the held backend
                while svc.orchestrator.pool.in_flight < 3:
                    await asyncio.sleep(0.05)
            svc.orchestrator.pool.add(healthy.base_url)
            os.killpg(doomed.pid, 9)
            view = await client.wait(job_id)
    assert [t.critical_error for t in view.results] == [None] * 3 and [t.reward for t in view.results] == [1.0] * 3


async def test_no_reachable_model_ends_rollouts_classified_not_hung(tmp_path: Path) -> None:
    from nemo_gym_prorl.agent.llm_pool import LLMPoolConfig

    pool = LLMPoolConfig(max_retries=1, backoff_base_s=0.01, wait_for_backend_s=2, health_interval_s=0, connect_timeout_s=2)
    async with service("http://127.0.0.1:9", tmp_path, llm_pool=pool) as svc, RolloutClient(svc.url) as client:
        view = await asyncio.wait_for(client.wait(await client.submit(JobRequest(instance=ROW, n=2))), 120)
    assert {t.critical_error for t in view.results} == {"run"}
    assert all("LLMUnavailable" in t.error for t in view.results)
    assert sandboxes_left() == []
