"""`prorl swe SUBCOMMAND`: light to import (the CLI imports it at start); the work is imported when asked for."""

from __future__ import annotations

import sys

SUBCOMMANDS = ("generate",)


def swe_command(args: list[str]) -> None:
    if not args or args[0] not in SUBCOMMANDS:
        print(f"prorl swe: a subcommand is needed: {', '.join(SUBCOMMANDS)} (prorl swe generate --help)", file=sys.stderr)
        raise SystemExit(2)
    from nemo_gym_prorl.swe.generate import main

    main(args[1:])
