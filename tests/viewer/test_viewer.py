"""The rollout viewer in a real headless browser (Debian's chromium through its chromedriver, one for the module).

The rollouts are real: a token-protected rollout service (in this process, on a thread of its own) runs them in
bubblewrap sandboxes against the stand-in model server (a real process, scripted replies, real token ids and
log-probs). Their trajectories, written as JSONL the way `prorl rollout` writes them, are opened with the real
`prorl view` command; the service's own pages are read under /ui. A test writes the screenshots docs/viewer.md shows.
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from queue import Queue

import httpx
import pytest
import yaml
from selenium.webdriver import ActionChains, Chrome
from selenium.webdriver.support.select import Select
from selenium.webdriver.support.wait import WebDriverWait
from standin_helpers import running_standin

from nemo_gym_prorl.cli import main
from nemo_gym_prorl.contracts.job import JobRequest
from nemo_gym_prorl.contracts.task import load_task
from nemo_gym_prorl.contracts.trajectory import Reverification, Trajectory
from nemo_gym_prorl.launch.runtime import ModelConfig, ServiceConfig, ServiceSettings
from nemo_gym_prorl.launch.serve import run_service
from nemo_gym_prorl.models.local_model import default_gguf
from nemo_gym_prorl.service.client import SyncRolloutClient
from nemo_gym_prorl.telemetry.report import RolloutReport
from nemo_gym_prorl.viewer.app import create_viewer_app
from nemo_gym_prorl.viewer.browser import headless_chromium
from nemo_gym_prorl.viewer.serving import serving_in_thread
from nemo_gym_prorl.viewer.sources import FileSource

REPO = Path(__file__).resolve().parents[2]
SCREENSHOTS = REPO / "docs" / "screenshots"
TOKEN = "viewer-test-token"
SCRIPT = ["```bash\necho $((6 * 7))\n```", "\\boxed{42}"]  # the stand-in's turns: a tool call, then an answer
RIGHT = {"id": "q-right", "question": "Calculate 6 * 7.", "answer": "42"}  # reward 1
WRONG = {"id": "q-wrong", "question": "Calculate 6 * 7 + 1.", "answer": "43"}  # reward 0
WAIT_S = 60
TASK = "math/arithmetic"  # the service's default task


class ServiceThread:
    """The rollout service in this process, served by an event loop on a thread of its own."""

    def __init__(self, config: ServiceConfig) -> None:
        self._config = config
        self._ready: Queue[str | BaseException] = Queue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(),), name="viewer-test-service")

    async def _serve(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        try:
            async with run_service(self._config) as service:
                self._ready.put(service.url)
                await self._stop.wait()
        except BaseException as e:
            self._ready.put(e)
            raise

    def __enter__(self) -> str:
        self._thread.start()
        started = self._ready.get(timeout=120)
        if isinstance(started, BaseException):
            raise started
        return started

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=60)


@pytest.fixture(scope="module")
def browser() -> Iterator[Chrome]:
    with headless_chromium() as driver:
        yield driver


@pytest.fixture(scope="module")
def service_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A service whose model takes 1 s a turn, so a job's rollouts are seen running on the live page."""
    folder = tmp_path_factory.mktemp("viewer-service")
    for model_url in running_standin(SCRIPT, latency_s=1.0):
        model = ModelConfig(kind="remote", addresses=[model_url], served_model_name="standin",
                            tool_call_format="codeact")
        config = ServiceConfig(service=ServiceSettings(port=0, store=folder / "service.db", token=TOKEN), model=model)
        with ServiceThread(config) as url:
            yield url


@pytest.fixture(scope="module")
def client(service_url: str) -> Iterator[SyncRolloutClient]:
    with SyncRolloutClient(service_url, token=TOKEN, timeout_s=120) as rollout_client:
        yield rollout_client


@pytest.fixture(scope="module")
def rollouts(client: SyncRolloutClient, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two GRPO groups of two samples (one instance right, one wrong), written by `prorl rollout`'s writer: the
    JSONL file and the run's record beside it (which names the task)."""
    jobs = [client.submit(JobRequest(instance=row, n=2, sampling_params={"seed": 1})) for row in (RIGHT, WRONG)]
    path = tmp_path_factory.mktemp("viewer-file") / "rollouts.jsonl"
    record = yaml.safe_dump({"config": {"model": {"kind": "remote"}},
                             "tasks": [load_task(TASK).model_dump(mode="json")]})
    with RolloutReport(path, TASK, record) as report:
        report.expect(4)
        for job_id in jobs:
            for trajectory in client.wait(job_id).results:
                report.add(trajectory)
    return path


@pytest.fixture(scope="module")
def viewer_url(rollouts: Path) -> Iterator[str]:
    """`prorl view` itself, as a user starts it, with the model's tokenizer to show token text."""
    process = subprocess.Popen(
        [sys.executable, "-m", "nemo_gym_prorl.cli", "view", str(rollouts), "--port", "0",
         "--tokenizer", str(default_gguf())],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("prorl view: "), process.stderr.read() if process.stderr else line
        yield line.split()[-1]
    finally:
        process.terminate()
        process.wait(timeout=30)


def file_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def listed(browser: Chrome) -> list[tuple[str, float]]:
    """(instance, reward) of each row the list shows, once the list has been drawn."""
    rows = browser.execute_script(  # read in one go: the list may be redrawn between two WebDriver calls
        "return [...document.querySelectorAll('#rows tr[data-index]')].map("
        "r => [r.querySelector('.instance').textContent, r.querySelector('.reward').textContent])"
    )
    return [(instance, float(reward)) for instance, reward in rows]


def wait_for(browser: Chrome, condition, message: str):  # noqa: ANN001, ANN201
    return WebDriverWait(browser, WAIT_S, poll_frequency=0.2).until(lambda _: condition(), message)


def choose(browser: Chrome, select_id: str, value: str) -> None:
    Select(browser.find_element("css selector", f"#{select_id}")).select_by_value(value)


def test_the_list_shows_every_trajectory_of_the_file_with_its_reward(browser: Chrome, viewer_url: str,
                                                                     rollouts: Path) -> None:
    expected = sorted((row["instance_id"], row["reward"]) for row in file_rows(rollouts))
    assert expected == [("q-right", 1.0), ("q-right", 1.0), ("q-wrong", 0.0), ("q-wrong", 0.0)]
    browser.get(viewer_url)
    wait_for(browser, lambda: len(listed(browser)) == 4, "the list never showed the file's 4 trajectories")
    assert sorted(listed(browser)) == expected
    assert browser.find_element("css selector", "#total").text == "4"


def test_filters_and_sort_narrow_and_order_the_list(browser: Chrome, viewer_url: str) -> None:
    browser.get(viewer_url)
    wait_for(browser, lambda: len(listed(browser)) == 4, "the list never showed")
    wait_for(browser, lambda: len(Select(browser.find_element("css selector", "#f-resolved")).options) == 3, "")
    choose(browser, "f-resolved", "false")
    wait_for(browser, lambda: listed(browser) == [("q-wrong", 0.0)] * 2, "resolved=no did not keep the 0 rewards")
    choose(browser, "f-resolved", "")
    wait_for(browser, lambda: "none" in [o.get_attribute("value") for o in
                                         Select(browser.find_element("css selector", "#f-critical_error")).options],
             "the critical-error filter never offered rollouts without one")
    choose(browser, "f-critical_error", "none")
    choose(browser, "f-finish", "answer")
    wait_for(browser, lambda: len(listed(browser)) == 4, "no critical error, finished by an answer: all four")
    choose(browser, "f-task", TASK)
    wait_for(browser, lambda: len(listed(browser)) == 4, "the task filter dropped rows of the task")
    reward_min = browser.find_element("css selector", "#f-reward_min")
    reward_min.send_keys("0.5\n")
    browser.execute_script("arguments[0].dispatchEvent(new Event('change', {bubbles: true}))", reward_min)
    wait_for(browser, lambda: listed(browser) == [("q-right", 1.0)] * 2, "reward >= 0.5 did not keep the 1s")
    reward_min.clear()
    browser.execute_script("arguments[0].dispatchEvent(new Event('change', {bubbles: true}))", reward_min)
    wait_for(browser, lambda: len(listed(browser)) == 4, "clearing the reward filter did not bring all back")
    browser.find_element("css selector", "th[data-sort=reward]").click()  # first click: highest first
    wait_for(browser, lambda: [r for _, r in listed(browser)] == [1.0, 1.0, 0.0, 0.0], "not sorted by reward")


def test_groups_show_each_instances_rewards_and_spread(browser: Chrome, viewer_url: str) -> None:
    browser.get(viewer_url + "#/groups")
    wait_for(browser, lambda: len(browser.find_elements("css selector", "#groups tr[data-group]")) == 2,
             "two GRPO groups expected")
    shown = browser.execute_script(
        "return [...document.querySelectorAll('#groups tr[data-group]')].map(r => [r.cells[2].textContent, "
        "[...r.querySelectorAll('.chip')].map(c => Number(c.textContent)), r.querySelector('.spread').textContent])"
    )
    assert sorted(shown) == [["q-right", [1.0, 1.0], "0"], ["q-wrong", [0.0, 0.0], "0"]]


def test_a_trajectory_page_shows_its_tool_calls_outputs_and_token_log_probs(browser: Chrome, viewer_url: str,
                                                                             rollouts: Path) -> None:
    row = file_rows(rollouts)[0]
    browser.get(viewer_url + "#/t/0")
    calls = browser.find_elements("css selector", ".entry.role-assistant .tool-call")
    assert calls and "echo $((6 * 7))" in calls[0].text
    outputs = browser.find_elements("css selector", ".entry.role-tool")
    assert outputs and "42" in outputs[0].text  # the bash tool really ran in the sandbox
    assert browser.find_element("css selector", "#final-answer").text == "42"
    assert "reason" in browser.find_element("css selector", "#evaluation").text
    assert browser.find_elements("css selector", "#timing .stage[data-stage=run]")
    spans = row["timing"]["spans"]  # per-call timings: each model request and tool call, with what it ran on
    for kind in ("model", "tool"):
        drawn = [s.get_attribute("title") for s in browser.find_elements("css selector", f"#spans .span.{kind}")]
        assert len(drawn) == sum(1 for span in spans if span["name"] == kind) > 0
    assert any("tool=bash" in title and "sandbox_backend=bwrap" in title for title in
               [s.get_attribute("title") for s in browser.find_elements("css selector", "#spans .span.tool")])

    first_turn = next(m for m in row["messages"] if "generation_token_ids" in m)  # the task's worked example has none
    counts = browser.find_element("css selector", ".entry.role-assistant .counts").text
    assert f"prompt {len(first_turn['prompt_token_ids'])} tokens" in counts
    assert f"generated {len(first_turn['generation_token_ids'])}" in counts
    details = browser.find_element("css selector", ".entry.role-assistant details.tokens")
    details.find_element("css selector", "summary").click()
    tokens = details.find_elements("css selector", ".tok")
    assert [int(t.get_attribute("data-id")) for t in tokens] == first_turn["generation_token_ids"]
    ActionChains(browser).move_to_element(tokens[1]).perform()
    tip = browser.find_element("css selector", "#tooltip")
    wait_for(browser, tip.is_displayed, "hovering a token showed no tooltip")
    lines = tip.text.splitlines()
    assert lines[0] == f"id {first_turn['generation_token_ids'][1]}"
    assert lines[1].startswith("text ") and "no tokenizer" not in lines[1]
    assert math.isclose(float(lines[2].split()[1]), first_turn["generation_log_probs"][1], abs_tol=1e-4)


def test_a_gym_eval_run_file_lists_its_rows_and_tool_calls(browser: Chrome) -> None:
    """A file NeMo Gym's `gym eval run` wrote (the example rollouts Gym ships for its multi-step server)."""
    import nemo_gym

    shipped = Path(nemo_gym.__file__).parents[1] / "resources_servers/example_multi_step/data/example_rollouts.jsonl"
    rows = [json.loads(line) for line in shipped.read_text().splitlines() if line.strip()]
    with serving_in_thread(create_viewer_app(FileSource(shipped))) as url:  # prorl view's app, in this process
        browser.get(url)
        wait_for(browser, lambda: len(listed(browser)) == min(len(rows), 50), "the Gym rows were not all listed")
        assert [r for _, r in listed(browser)] == [float(row["reward"]) for row in rows][:50]
        browser.get(url + "#/t/0")
        calls = [c.text for c in browser.find_elements("css selector", ".tool-call")]
        expected = [i["name"] for i in rows[0]["response"]["output"] if i["type"] == "function_call"]
        assert [c.splitlines()[0] for c in calls] == expected
        assert len(browser.find_elements("css selector", ".entry.role-tool")) == len(expected)


def test_the_live_page_updates_while_a_job_runs(browser: Chrome, service_url: str, client: SyncRolloutClient,
                                                rollouts: Path) -> None:
    browser.get(f"{service_url}/ui/?token={TOKEN}#/live")
    finished = browser.find_element("css selector", "#live-finished")
    wait_for(browser, lambda: finished.text == str(len(file_rows(rollouts))), "the live page did not count the "
             "rollouts done before")
    before = int(finished.text)
    job_id = client.submit(JobRequest(instance=RIGHT, n=3, sampling_params={"seed": 2}))

    def running() -> bool:  # read in one script: the page redraws the table between two element reads
        cells = browser.execute_script("return [...document.querySelectorAll("
                                       "'#live-stages td.queued, #live-stages td.active')].map(c => c.textContent)")
        return any(int(c) > 0 for c in cells)

    wait_for(browser, running, "the live page never showed the job's rollouts queued or active")
    wait_for(browser, lambda: int(finished.text) == before + 3, "the live page never counted the job's rollouts")
    assert client.wait(job_id).finished == 3
    rates = browser.find_element("css selector", "svg[data-series=rate] polyline").get_attribute("data-values")
    assert any(float(rate) > 0 for rate in rates.split())  # the rollouts/s plot rose while the job finished
    rewards = browser.find_element("css selector", "svg[data-series=reward] polyline").get_attribute("data-values")
    assert 1.0 in [float(reward) for reward in rewards.split()]  # the job's rollouts are all right
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(SCREENSHOTS / "live.png"))  # docs/viewer.md's, with the job's plots


def test_pages_under_a_token_protected_service_refuse_requests_without_it(browser: Chrome, service_url: str) -> None:
    for path in ("/ui/", "/ui/static/viewer.js", "/ui/api/trajectories", "/ui/api/live", "/ui/api/trajectories/0"):
        assert httpx.get(service_url + path).status_code == 401, path
        assert httpx.get(service_url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401, path
    assert httpx.get(service_url + "/ui/?token=wrong", follow_redirects=False).status_code == 401
    assert httpx.get(service_url + "/ui", follow_redirects=False).headers["location"].endswith("/ui/")
    answer = httpx.get(service_url + "/ui/api/trajectories", headers={"Authorization": f"Bearer {TOKEN}"})
    assert answer.status_code == 200 and answer.json()["total"] >= 4

    browser.delete_all_cookies()
    browser.get(f"{service_url}/ui/")
    assert "missing or wrong bearer token" in browser.find_element("css selector", "body").text
    browser.get(f"{service_url}/ui/?token={TOKEN}")  # once with the token: a cookie for the pages after
    assert browser.current_url == f"{service_url}/ui/"
    wait_for(browser, lambda: len(listed(browser)) >= 4, "with the token the service's rollouts are listed")


def test_prorl_view_refuses_what_it_cannot_show_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PRORL_SERVICE_TOKEN", raising=False)
    bad = tmp_path / "rollouts.jsonl"
    bad.write_text('{"instance_id": "a", "trajectory_id": "j:0", "reward": 1}\nnot json\n')
    good = tmp_path / "good.jsonl"
    good.write_text('{"instance_id": "a", "trajectory_id": "j:0", "reward": 1}\n')
    cases = (([str(bad)], f"{bad}:2: not JSON"), ([str(tmp_path / "none.jsonl")], "no such file"),
             ([str(good), "--host", "0.0.0.0"], "--host 0.0.0.0 (not loopback) needs a token"),
             ([str(good), "--tokenizer", str(tmp_path / "none.gguf")], "none.gguf: no such file"))
    for argv, message in cases:
        with pytest.raises(SystemExit) as stopped:
            main(["view", *argv, "--port", "0"])
        assert stopped.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("prorl: error: ") and message in err and "\n" not in err


def test_screenshots_of_the_main_pages(browser: Chrome, viewer_url: str) -> None:
    """docs/screenshots/*.png, linked from docs/viewer.md: the list, the groups, a trajectory (and the live page,
    written by the live test while its job's plots are on it)."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    browser.get(viewer_url)
    wait_for(browser, lambda: len(listed(browser)) == 4, "the list never showed")
    assert browser.save_screenshot(str(SCREENSHOTS / "list.png"))
    browser.get(viewer_url + "#/groups")
    wait_for(browser, lambda: browser.find_elements("css selector", "#groups tr[data-group]"), "no groups")
    assert browser.save_screenshot(str(SCREENSHOTS / "groups.png"))
    browser.get(viewer_url + "#/t/0")
    browser.find_element("css selector", "details.tokens summary").click()
    browser.set_window_size(1400, 2000)  # the whole page: timings, grader, conversation, a token hovered
    try:
        ActionChains(browser).move_to_element(browser.find_elements("css selector", ".tok")[2]).perform()
        assert browser.save_screenshot(str(SCREENSHOTS / "trajectory.png"))
    finally:
        browser.set_window_size(1400, 1000)
    assert sorted(p.name for p in SCREENSHOTS.glob("*.png")) == ["groups.png", "list.png", "live.png",
                                                                 "trajectory.png"]


def test_regraded_rollouts_show_old_and_new_rewards_side_by_side(browser: Chrome, rollouts: Path,
                                                                   tmp_path: Path) -> None:
    """A file as `prorl reverify` writes it: each trajectory with its new grade and a record of the old one."""
    regraded = tmp_path / "reverified.jsonl"
    with regraded.open("w") as file:
        for i, line in enumerate(rollouts.read_text().splitlines()):
            trajectory = Trajectory.model_validate_json(line)
            changed = i == 0  # say the grader's fix took the first rollout's reward from 0 to its 1
            old = Reverification(old_reward=0.0 if changed else trajectory.reward, old_resolved=False if changed
                                 else trajectory.resolved, old_evaluation={"reason": "old grader"},
                                 reward=trajectory.reward, resolved=trajectory.resolved, changed=changed)
            file.write(trajectory.model_copy(update={"reverify": old}).model_dump_json() + "\n")
    with serving_in_thread(create_viewer_app(FileSource(regraded))) as url:  # cheaper than another process
        browser.get(url)
        wait_for(browser, lambda: len(listed(browser)) == 4, "the re-graded file was not listed")
        assert browser.find_element("css selector", "th[data-sort=old_reward]").is_displayed()
        choose(browser, "f-changed", "true")
        wait_for(browser, lambda: listed(browser) == [("q-right", 1.0)], "changed=yes did not keep the one changed")
        assert browser.find_element("css selector", "#rows .old-reward").text.startswith("0.000")
        browser.get(url + "#/t/0")
        assert browser.find_element("css selector", "#evaluation .old-reward").text == "0.000"
        assert browser.find_element("css selector", "#evaluation .new-reward").text == "1.000"
        assert "old grader" in browser.find_element("css selector", "#evaluation").text


def test_a_patch_shows_as_a_diff(browser: Chrome, rollouts: Path, tmp_path: Path) -> None:
    """A SWE rollout's trajectory keeps the patch it was graded on (`submission.patch`): shown as a diff."""
    patch = "diff --git a/m.py b/m.py\n--- a/m.py\n+++ b/m.py\n@@ -1 +1 @@\n-return a - b\n+return a + b\n"
    trajectory = Trajectory.model_validate_json(rollouts.read_text().splitlines()[0])
    path = tmp_path / "swe.jsonl"
    path.write_text(trajectory.model_copy(update={"submission": {"patch": patch}}).model_dump_json() + "\n")
    with serving_in_thread(create_viewer_app(FileSource(path))) as url:
        browser.get(url + "#/t/0")
        diff = browser.find_element("css selector", "#patch")
        assert [line.text for line in diff.find_elements("css selector", ".diff-add")] == ["+return a + b"]
        assert [line.text for line in diff.find_elements("css selector", ".diff-del")] == ["-return a - b"]
        assert diff.find_element("css selector", ".diff-hunk").text == "@@ -1 +1 @@"
