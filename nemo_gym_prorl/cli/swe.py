"""`prorl swe SUBCOMMAND`: light to import (the CLI imports it at start); the work is imported when asked for."""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = {"generate": "nemo_gym_prorl.envs.swe.generator.generate", "check": "nemo_gym_prorl.envs.swe.generator.check"}


def swe_command(args: list[str]) -> None:
    if not args or args[0] not in SUBCOMMANDS:
        names = ", ".join(SUBCOMMANDS)
        print(f"prorl swe: a subcommand is needed: {names} (prorl swe generate --help)", file=sys.stderr)
        raise SystemExit(2)
    code = importlib.import_module(SUBCOMMANDS[args[0]]).main(args[1:])
    if code:
        raise SystemExit(code)
