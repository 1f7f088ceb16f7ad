"""The viewer's reading of rows, without a browser: NeMo Gym's rollout rows (as Gym ships them), the list's
filters, sorts and groups, a long file read in the background, a bad line, a service's store followed live."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import nemo_gym
import pytest

from nemo_gym_prorl.bench.viewer import trajectory, write_file
from nemo_gym_prorl.contracts.trajectory import Trajectory
from nemo_gym_prorl.service.store import JobStore
from nemo_gym_prorl.viewer.app import create_viewer_app
from nemo_gym_prorl.viewer.index import GroupQuery, ListQuery, facets, groups, page
from nemo_gym_prorl.viewer.records import conversation, summarize
from nemo_gym_prorl.viewer.sources import FileSource, RolloutFileError, StoreSource

GYM_ROWS = Path(nemo_gym.__file__).parents[1] / "resources_servers/example_multi_step/data/example_rollouts.jsonl"


def test_a_gym_eval_row_becomes_a_conversation_with_its_tool_calls_and_outputs() -> None:
    row = json.loads(GYM_ROWS.read_text().splitlines()[0])
    entries = conversation(row)
    calls = [item for item in row["response"]["output"] if item["type"] == "function_call"]
    outputs = [item for item in row["response"]["output"] if item["type"] == "function_call_output"]
    shown_calls = [call for entry in entries for call in entry.get("tool_calls", [])]
    assert [c["name"] for c in shown_calls] == [c["name"] for c in calls]
    tool_entries = [e for e in entries if e["role"] == "tool"]
    assert [e["content"] for e in tool_entries] == [o["output"] for o in outputs]
    assert [e["name"] for e in tool_entries] == [c["name"] for c in calls]  # each output names the call it answers
    assert [e["role"] for e in entries[:2]] == [m["role"] for m in row["responses_create_params"]["input"][:2]]
    assert entries[-1]["role"] == "assistant"
    summary = summarize(0, row)
    assert (summary.reward, summary.tool_calls, summary.resolved) == (row["reward"], len(calls), None)


def test_a_worked_example_stays_in_the_prompt_and_observations_after_it_are_tool_outputs() -> None:
    turn = {"prompt_token_ids": [1], "generation_token_ids": [2], "generation_log_probs": [-0.5]}
    messages = [
        {"role": "user", "content": "Calculate 12 * -3."},
        {"role": "assistant", "content": "```python\nprint(12 * -3)\n```"},
        {"role": "user", "content": "Observation (python):\n-36\n"},  # the example's, written by the task
        {"role": "assistant", "content": "\\boxed{-36}"},
        {"role": "user", "content": "Calculate 6 * 7."},
        {"role": "assistant", "content": "```python\nprint(6 * 7)\n```", **turn},
        {"role": "user", "content": "Observation (python):\n42\n"},  # the sandbox's
    ]
    entries = conversation({"messages": messages})
    assert [e["role"] for e in entries] == ["user", "assistant", "user", "assistant", "user", "assistant", "tool"]
    assert entries[-1]["name"] == "python" and entries[-1]["content"].strip() == "42"
    assert "token_ids" in entries[5] and "token_ids" not in entries[1]


def test_token_fields_on_gym_output_items_are_the_turns_tokens() -> None:
    row = {"responses_create_params": {"input": "hi"}, "reward": 0.5, "_ng_task_index": 3, "_ng_rollout_index": 1,
           "response": {"output": [
               {"type": "message", "content": [{"type": "output_text", "text": "a"}]},
               {"type": "function_call", "name": "bash", "arguments": "{}", "call_id": "c1",
                "prompt_token_ids": [1, 2], "generation_token_ids": [3, 4], "generation_log_probs": [-0.1, -0.2]},
               {"type": "function_call_output", "call_id": "c1", "output": "ok"},
               {"type": "message", "content": [{"type": "output_text", "text": "done"}],
                "prompt_token_ids": [1, 2, 3, 4, 5], "generation_token_ids": [6], "generation_log_probs": [-1.0]},
           ]}}
    entries = conversation(row)
    turns = [e for e in entries if e["role"] == "assistant"]
    assert [(t["content"], t["token_ids"], t["prompt_tokens"]) for t in turns] == [("a", [3, 4], 2), ("done", [6], 5)]
    summary = summarize(7, row)
    assert (summary.group, summary.sample, summary.turns, summary.tool_calls) == ("3", 1, 2, 1)


def test_filters_sorts_and_groups_over_summaries() -> None:
    import random

    rng = random.Random(1)
    rows = [summarize(i, trajectory(rng, i // 4, i % 4), task="math/arithmetic") for i in range(16)]
    rows[5] = rows[5].model_copy(update={"critical_error": "timeout", "finish": None})
    kept = page(rows, ListQuery(resolved=False, sort="reward"))
    assert kept.total == sum(1 for r in rows if not r.resolved) and all(r.reward == 0 for r in kept.rows)
    assert [r.index for r in page(rows, ListQuery(critical_error="timeout")).rows] == [5]
    assert page(rows, ListQuery(critical_error="none")).total == 15
    assert page(rows, ListQuery(finish="none")).total == 1
    by_reward = page(rows, ListQuery(sort="reward", desc=True, limit=16)).rows
    assert [r.reward for r in by_reward] == sorted((r.reward for r in rows), reverse=True)
    grouped = groups(rows, GroupQuery(sort="spread", desc=True))
    assert grouped.total == 4
    for group in grouped.groups:
        members = [r for r in rows if r.group == group.group]
        assert group.rewards == [r.reward for r in sorted(members, key=lambda r: r.sample)]
        assert group.spread == max(group.rewards) - min(group.rewards)
    assert [g.spread for g in grouped.groups] == sorted((g.spread for g in grouped.groups), reverse=True)
    assert facets(rows).critical_errors == {"none": 15, "timeout": 1}


def test_a_long_file_lists_its_first_rows_at_once_and_the_rest_in_the_background(tmp_path: Path) -> None:
    path = tmp_path / "rollouts.jsonl"
    write_file(path, 300)
    with path.open("a") as file:
        file.write("\n{broken\n")
    source = FileSource(path, first_rows=50)
    assert len(source.summaries()) >= 50 and 250 < (source.expected or 0) < 350  # estimated from the first rows
    assert source.complete.wait(timeout=60)
    assert len(source.summaries()) == source.expected == 300  # every good row, then the bad line named
    assert source.error is not None and source.error.startswith(f"{path}:302: not JSON (")
    assert source.row(299)["trajectory_id"] == "job00074:3"


def test_a_bad_first_line_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "rollouts.jsonl"
    path.write_text('{"question": "no trajectory"}\n')
    with pytest.raises(RolloutFileError, match=r"rollouts.jsonl:1: neither a prorl trajectory"):
        FileSource(path)


def test_the_service_source_follows_the_store_as_results_arrive() -> None:
    store = JobStore(":memory:")
    source = StoreSource(store, default_task="math/arithmetic")
    assert list(source.summaries()) == []
    store.add_job("j1", {"instance": {}, "task": "code/humaneval"}, 2)
    store.add_result("j1", 0, Trajectory(instance_id="a", trajectory_id="j1:0", reward=1.0))
    store.add_job("j2", {"instance": {}}, 1)
    store.add_result("j2", 0, Trajectory(instance_id="b", trajectory_id="j2:0", reward=0.0))
    assert [(s.trajectory_id, s.task, s.reward) for s in source.summaries()] == [
        ("j1:0", "code/humaneval", 1.0), ("j2:0", "math/arithmetic", 0.0)]
    store.add_result("j1", 0, Trajectory(instance_id="a", trajectory_id="j1:0", reward=0.25))  # written again
    store.add_result("j1", 1, Trajectory(instance_id="a", trajectory_id="j1:1", reward=0.5))
    assert [(s.index, s.trajectory_id, s.reward) for s in source.summaries()] == [
        (0, "j1:0", 0.25), (1, "j2:0", 0.0), (2, "j1:1", 0.5)]
    assert source.row(2)["reward"] == 0.5
    store.close()


async def test_a_bad_query_is_refused_naming_the_parameter(tmp_path: Path) -> None:
    path = tmp_path / "rollouts.jsonl"
    write_file(path, 8)
    app = create_viewer_app(FileSource(path))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://viewer") as client:
        for params, field in (({"reward_min": "high"}, "reward_min"), ({"sort": "colour"}, "sort")):
            answer = await client.get("/api/trajectories", params=params)
            assert answer.status_code == 422 and answer.json()["error"]["field"] == field
        assert (await client.get("/api/trajectories/8")).status_code == 404
        assert (await client.get("/api/live")).status_code == 404  # a file has no live counters
        listed = (await client.get("/api/trajectories", params={"sort": "reward", "desc": "true"})).json()
        assert listed["total"] == 8 and [r["reward"] for r in listed["rows"]] == sorted(
            (json.loads(line)["reward"] for line in path.read_text().splitlines()), reverse=True)
