"""llama.cpp's log, as Python logging records of the logger ``llama.cpp`` at their true level.

llama-cpp-python 0.3.36 maps ggml's log levels one step too high (its table predates GGML_LOG_LEVEL_DEBUG = 1), so
with ``verbose=False`` llama.cpp's warnings still reach the terminal as "errors" — e.g. the
``n_ctx_seq (512) > n_ctx_train (0)`` a vocabulary-only load always triggers (such a model has no hyper-parameters,
so its training context reads 0). Routed here, each line is a record the application's logging config places:
`prorl` writes them to the run's log file, not the terminal.
"""

from __future__ import annotations

import ctypes
import logging

import llama_cpp

logger = logging.getLogger("llama.cpp")

# enum ggml_log_level (ggml.h): NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5 (continues the previous message)
_LEVELS = {0: logging.INFO, 1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
_CONTINUE = 5


class _LineAssembler:
    """llama.cpp writes a message in pieces; a record is made per complete line, at the level it started with."""

    def __init__(self) -> None:
        self.level = logging.INFO
        self.pending = ""

    def feed(self, level: int, text: bytes) -> None:
        if level != _CONTINUE:
            self.level = _LEVELS.get(level, logging.INFO)
        self.pending += text.decode("utf-8", errors="replace")
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            if line.strip():
                logger.log(self.level, "%s", line)


_assembler = _LineAssembler()


@llama_cpp.llama_log_callback
def _callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    _assembler.feed(level, text)


def route_llama_logs() -> None:
    """Send every later llama.cpp/ggml log message to the ``llama.cpp`` logger (idempotent; process-wide)."""
    llama_cpp.llama_log_set(_callback, ctypes.c_void_p(0))
