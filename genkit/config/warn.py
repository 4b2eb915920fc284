"""Warnings about a configuration, each logged once per process (transformers' ``warning_once``).

Where they go (docs/api.md, "Warnings"):

- transformers not loaded in this process: the ``genkit.config`` logger (Python's ``logging``).
- transformers loaded: through transformers' generation logger
  (``transformers.generation.configuration_utils``, where transformers' own ``GenerationConfig``
  warnings go), so ``transformers.logging.set_verbosity_error()`` silences them and the handlers
  transformers' logging API adds (``transformers.logging.add_handler``, ``CaptureLogger``) capture
  them. The record keeps the name ``genkit.config``; it also reaches the handlers set along
  genkit's own chain (``genkit.config``, ``genkit``, the root logger: a logging config, pytest's
  ``caplog``), each handler once.

A warning silenced when it came up (by either logger's level) is not marked as given: it shows the
next time it comes up with warnings enabled. ``WARNED.clear()`` forgets what was given.
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("genkit.config")

#: transformers' logger for generation-config warnings
TRANSFORMERS_LOGGER = "transformers.generation.configuration_utils"

WARNED: set[str] = set()


def _transformers_logger() -> logging.Logger | None:
    """transformers' generation logger, when transformers is loaded (never imported here)."""
    if "transformers" not in sys.modules:
        return None
    return logging.getLogger(TRANSFORMERS_LOGGER)


def _chain(log: logging.Logger) -> list[logging.Handler]:
    """The handlers a record logged on ``log`` reaches (``log``'s, then its parents' while it propagates)."""
    found: list[logging.Handler] = []
    current: logging.Logger | None = log
    while current is not None:
        found.extend(current.handlers)
        current = current.parent if current.propagate else None
    return found


def emit(message: str) -> bool:
    """Log ``message`` as a warning where the module doc says; False when a level silenced it."""
    if not logger.isEnabledFor(logging.WARNING):
        return False
    target = _transformers_logger()
    if target is None:
        logger.warning(message)
        return True
    if not target.isEnabledFor(logging.WARNING):
        return False
    record = logger.makeRecord(logger.name, logging.WARNING, __file__, 0, message, None, None)
    handlers = list(dict.fromkeys(_chain(target) + _chain(logger)))  # each handler once (pytest shares some)
    for handler in handlers:
        if record.levelno >= handler.level:
            handler.handle(record)
    if not handlers and logging.lastResort is not None:
        logging.lastResort.handle(record)
    return True


def warn_once(message: str) -> None:
    """Log ``message`` as a warning the first time it comes up (and is not silenced) in this process."""
    if message not in WARNED and emit(message):
        WARNED.add(message)
