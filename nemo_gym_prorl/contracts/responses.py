"""A conversation as NeMo Gym Responses-API output items, the shape Gym verifiers and NeMo RL read.

Each assistant turn becomes a ``message`` item (its text) and ``function_call`` items (its tool calls), with the
turn's ``prompt_token_ids``/``generation_token_ids``/``generation_log_probs`` on the last of them — NeMo RL trains
on exactly the items that carry all three. Tool results become ``function_call_output`` items.
"""

from __future__ import annotations

import uuid
from typing import Any

from nemo_gym_prorl.contracts.trajectory import TOKEN_FIELDS


def gym_output_items(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    pending_calls: list[str] = []
    for message in messages:
        role = message.get("role")
        if role == "assistant" and "generation_token_ids" in message:
            turn: list[dict[str, Any]] = []
            if message.get("content"):
                turn.append(
                    {
                        "id": f"msg_{uuid.uuid4().hex[:16]}",
                        "type": "message",
                        "role": "assistant",
                        "status": "completed",
                        "content": [{"type": "output_text", "text": message["content"], "annotations": []}],
                    }
                )
            pending_calls = []
            for call in message.get("tool_calls") or []:
                pending_calls.append(call["id"])
                turn.append(
                    {
                        "type": "function_call",
                        "call_id": call["id"],
                        "name": call["function"]["name"],
                        "arguments": call["function"]["arguments"],
                        "status": "completed",
                    }
                )
            if not turn:  # an empty reply still carries its tokens (e.g. just the end-of-turn token)
                turn.append({"id": f"msg_{uuid.uuid4().hex[:16]}", "type": "message", "role": "assistant", "status": "completed", "content": []})
            turn[-1].update({field: message[field] for field in TOKEN_FIELDS})
            items += turn
        elif pending_calls and role in ("tool", "user"):
            # tool results follow their assistant turn in call order (codeact sends them as user messages)
            items.append({"type": "function_call_output", "call_id": pending_calls.pop(0), "output": message.get("content") or ""})
        else:
            pending_calls = []
    return items
