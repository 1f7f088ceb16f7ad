"""`prorl view FILE`: the rollout viewer over a JSONL file `prorl rollout` or NeMo Gym's `gym eval run` wrote."""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import os
import socket
from pathlib import Path
from typing import Any

import uvicorn

from nemo_gym_prorl.telemetry.report import read_config_record
from nemo_gym_prorl.viewer.app import create_viewer_app
from nemo_gym_prorl.viewer.detail import TokenTexts
from nemo_gym_prorl.viewer.sources import FileSource, RolloutFileError

NO_TOKENIZER = "none"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prorl view", description="Show a rollout file in the browser: a list with filters and GRPO groups, "
        "each trajectory with its tool calls, token log-probs, grader details and timings.")
    parser.add_argument("file", type=Path, help="a JSONL file of `prorl rollout` or `gym eval run`")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8300, help="0: any free port")
    parser.add_argument("--task", help="the task of rows that name none (default: the run's, from FILE's "
                        ".config.yaml)")
    parser.add_argument("--tokenizer", help="a GGUF whose vocabulary decodes token ids to text (default: the run's "
                        f"local model, from FILE's .config.yaml); {NO_TOKENIZER!r}: show ids only")
    parser.add_argument("--token", help="bearer token the pages need (also $PRORL_SERVICE_TOKEN, as for the "
                        "service); required beyond loopback")
    return parser


def _tokenizer_gguf(choice: str | None, file: Path) -> Path | None:
    if choice == NO_TOKENIZER:
        return None
    if choice is not None:
        gguf = Path(choice)
        if not gguf.is_file():
            raise RolloutFileError(f"--tokenizer {choice}: no such file")
        return gguf
    model: dict[str, Any] = (read_config_record(file).get("config") or {}).get("model") or {}
    if model.get("kind", "local") != "local" or not model:
        return None
    if model.get("gguf"):
        return Path(model["gguf"]) if Path(model["gguf"]).is_file() else None
    from nemo_gym_prorl.models.local_model import default_gguf

    try:
        return default_gguf()
    except FileNotFoundError:
        return None


def _listen(host: str, port: int) -> socket.socket:
    from nemo_gym_prorl.launch.startup import StartupError

    try:
        return socket.create_server((host, port))
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise StartupError(f"--port {port}: port {port} on {host} is already in use: choose another "
                               "(--port 0: any free port)") from None
        raise StartupError(f"--host {host} --port {port}: cannot listen there: {e.strerror or e}") from None


def view(args: list[str]) -> None:
    from nemo_gym_prorl.launch.runtime import TOKEN_ENV
    from nemo_gym_prorl.service.app import is_loopback

    options = _parser().parse_args(args)
    token = options.token or os.environ.get(TOKEN_ENV) or None
    if token is None and not is_loopback(options.host):
        raise RolloutFileError(f"--host {options.host} (not loopback) needs a token: --token or ${TOKEN_ENV}")
    if not options.file.is_file():
        raise RolloutFileError(f"{options.file}: no such file")
    source = FileSource(options.file, task=options.task)
    gguf = _tokenizer_gguf(options.tokenizer, options.file)
    if gguf is not None:  # a vocabulary-only load makes llama.cpp warn about the context size: not the user's concern
        from nemo_gym_prorl.models.llama_log import route_llama_logs

        route_llama_logs()
        logging.getLogger("llama.cpp").setLevel(logging.ERROR)
    texts = TokenTexts(gguf=gguf)
    sock = _listen(options.host, options.port)
    app = create_viewer_app(source, texts, token=token)
    url = f"http://{options.host}:{sock.getsockname()[1]}/"
    print(f"prorl view: {options.file} on {url}", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    asyncio.run(server.serve(sockets=[sock]))
