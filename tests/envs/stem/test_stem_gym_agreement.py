"""Our multiple-choice grading against NeMo Gym's own mcqa, gpqa_diamond and bunsenbench_chemistry_mcq verifiers,
on Gym's example rows and rollouts and on replies made from them (every grading mode). Prints the figures; the
docs/code-and-stem.md states them."""

from __future__ import annotations

import json
from pathlib import Path
from unittest.mock import MagicMock

import resources_servers.bunsenbench_chemistry_mcq as bunsen_pkg
import resources_servers.gpqa_diamond as gpqa_pkg
import resources_servers.mcqa as mcqa_pkg
from nemo_gym.openai_utils import NeMoGymResponse
from nemo_gym.server_utils import ServerClient
from resources_servers.bunsenbench_chemistry_mcq.app import (
    BunsenChemResourcesServer,
    BunsenChemResourcesServerConfig,
    BunsenChemVerifyRequest,
)  # fmt: skip
from resources_servers.gpqa_diamond.app import GPQADiamondResourcesServer, GPQADiamondResourcesServerConfig
from resources_servers.mcqa.app import MCQAResourcesServer, MCQAResourcesServerConfig, MCQAVerifyRequest

from nemo_gym_prorl.envs.stem.env import grade_choice
from nemo_gym_prorl.envs.stem.mcqa import option_letters

MODES = ["strict_single_letter_boxed", "lenient_boxed", "lenient_answer_colon", "lenient_answer_colon_md"]


def _rows(package: object, name: str) -> list[dict]:
    return [json.loads(line) for line in (Path(package.__path__[0]) / "data" / name).read_text().splitlines()]


def _response(text: str) -> NeMoGymResponse:
    return NeMoGymResponse(
        id="resp", created_at=0.0, model="m", object="response", parallel_tool_calls=True, tool_choice="auto",
        tools=[], output=[{"id": "msg", "role": "assistant", "status": "completed", "type": "message",
                           "content": [{"type": "output_text", "text": text, "annotations": []}]}],
    )  # fmt: skip


def _replies(row: dict) -> list[str]:
    """Replies a model writes, right and wrong, in every shape the modes read."""
    letters = option_letters(row["options"])
    gold = row["expected_answer"]
    wrong = next(letter for letter in letters if letter != gold)
    text = letters[gold]
    return [
        f"\\boxed{{{gold}}}", f"\\boxed{{{wrong}}}", f"\\boxed{{\\text{{{gold}}}}}", f"\\boxed{{({gold})}}",
        f"\\boxed{{{gold}: {text}}}", f"\\boxed{{{text}}}", f"Answer: {gold}", f"Answer: {wrong}", f"Answer: {text}",
        f"**Answer:** {gold}", f"Answer: {gold} or {wrong}", f"I think {gold}.", f"\\boxed{{{wrong}}}\nAnswer: {gold}",
        f"Answer: {wrong}\nAnswer: {gold}", "", "\\boxed{Z}", f"Final Choice: {gold}", f"ANSWER IS {gold}",
    ]  # fmt: skip


def _rollout_texts(package: object, name: str) -> list[tuple[dict, str]]:
    out = []
    for rollout in _rows(package, name):
        text = "".join(p["text"] for item in rollout["response"]["output"] if item["type"] == "message"
                       for p in item["content"] if p["type"] == "output_text")
        out.append((rollout, text))
    return out


async def test_agreement_with_gym_mcqa_and_gpqa_verifiers() -> None:
    mcqa_rows = _rows(mcqa_pkg, "example.jsonl") + _rows(mcqa_pkg, "example_with_template_metadata.jsonl")
    cases = []  # (server, mode, row, reply)
    for mode in MODES:
        for row in mcqa_rows:
            cases += [("mcqa", mode, row, reply) for reply in _replies(row)]
        cases += [("mcqa", mode, r, t) for r, t in _rollout_texts(mcqa_pkg, "example_rollouts.jsonl")]
    for row in _rows(gpqa_pkg, "example.jsonl"):
        cases += [("gpqa_diamond", "boxed_or_answer_colon", row, reply) for reply in _replies(row)]
    cases += [("gpqa_diamond", "boxed_or_answer_colon", r, t) for r, t in _rollout_texts(gpqa_pkg, "example_rollouts.jsonl")]

    def server(name: str, mode: str):
        if name == "gpqa_diamond":
            config = GPQADiamondResourcesServerConfig(host="127.0.0.1", port=0, entrypoint="", name="")
            return GPQADiamondResourcesServer(config=config, server_client=MagicMock(spec=ServerClient))
        config = MCQAResourcesServerConfig(host="127.0.0.1", port=0, entrypoint="", name="", grading_mode=mode)
        return MCQAResourcesServer(config=config, server_client=MagicMock(spec=ServerClient))

    servers = {(name, mode): server(name, mode) for name, mode, _, _ in cases}
    agree: dict[tuple[str, str], list[int]] = {}
    disagreements = []
    for name, mode, row, reply in cases:
        fields = {k: row[k] for k in ("options", "expected_answer", "template_metadata", "grading_mode") if k in row}
        params = {"input": row["responses_create_params"]["input"]}
        request = MCQAVerifyRequest(responses_create_params=params, response=_response(reply),
                                    **fields)
        gyms = (await servers[(name, mode)].verify(request)).reward
        ours = grade_choice(reply.strip(), row, mode).reward
        tally = agree.setdefault((name, mode), [0, 0])
        tally[0] += ours == gyms
        tally[1] += 1
        if ours != gyms:
            disagreements.append((name, mode, reply, ours, gyms))
    print("\nmultiple-choice agreement with Gym's verifiers:")
    for (name, mode), (same, total) in agree.items():
        print(f"  {name:13s} {mode:27s} {same}/{total}")
    for name, mode, reply, ours, gyms in disagreements:
        print(f"  differs: {name} {mode}: {reply[-80:]!r}: ours {ours}, Gym {gyms}")
    total = sum(t for _, t in agree.values())
    print(f"  overall {total - len(disagreements)}/{total}")
    assert not disagreements


def _bunsen_replies(row: dict) -> list[str]:
    """Replies in the shapes BunsenBench's prompt asks for and models write instead."""
    letters = option_letters(row["options"])
    gold = row["expected_answer"]
    wrong = next(letter for letter in letters if letter != gold)
    text, wrong_text = letters[gold], letters[wrong]
    listed = "".join(f"<choice>{option}</choice>" for option in letters.values())
    return _replies(row) + [
        f"<choice>{text}</choice>", f"<choice>{gold}</choice>", f"<choice>{text.lower()}</choice>",
        f"<choice>{text.upper()}</choice>", f"<answer>{text}</answer>", f"<choice>{wrong_text}</choice>",
        f"Reasoning first.\n{text}", f"Reasoning first.\n{text.lower()}", f"The answer is {gold}.",
        f"<choices>{listed}</choices>", f"<choice>{wrong_text}</choice>\nOn reflection:\nAnswer: {gold}",
        f"I choose {gold} and {wrong}", f"Option {gold}", f"{gold}) {text}", f"\\boxed{{\\text{{{text}}}}}",
    ]  # fmt: skip


async def test_agreement_with_gym_bunsenbench_verifier() -> None:
    """BunsenBench's chemistry rows, read as Gym's bunsenbench_chemistry_mcq server reads them: <choice> tags,
    boxes, Answer: lines, the option's exact text (case kept: CO is not Co)."""
    config = BunsenChemResourcesServerConfig(host="127.0.0.1", port=0, entrypoint="", name="")
    server = BunsenChemResourcesServer(config=config, server_client=MagicMock(spec=ServerClient))
    cases = [(row, reply) for row in _rows(bunsen_pkg, "example.jsonl") for reply in _bunsen_replies(row)]
    cases += _rollout_texts(bunsen_pkg, "example_rollouts.jsonl")
    disagreements = []
    for row, reply in cases:
        request = BunsenChemVerifyRequest(
            responses_create_params={"input": row["responses_create_params"]["input"]}, response=_response(reply),
            options=row["options"], expected_answer=row["expected_answer"],
        )  # fmt: skip
        gyms = (await server.verify(request)).reward
        ours = grade_choice(reply.strip(), row, "choice_tag_or_answer").reward
        if ours != gyms:
            disagreements.append((reply, ours, gyms))
    print(f"\nbunsenbench agreement with Gym's verifier: {len(cases) - len(disagreements)}/{len(cases)}")
    for reply, ours, gyms in disagreements:
        print(f"  differs: {reply[-80:]!r}: ours {ours}, Gym {gyms}")
    assert not disagreements
