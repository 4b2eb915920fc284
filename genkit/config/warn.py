"""Warnings about a configuration, each logged once per process (transformers' ``warning_once``)
on the ``genkit.config`` logger."""

from __future__ import annotations

import logging

logger = logging.getLogger("genkit.config")



WARNED: set[str] = set()


def warn_once(message: str) -> None:
    """Log ``message`` as a warning the first time it comes up in this process."""
    if message not in WARNED:
        WARNED.add(message)
        logger.warning(message)

