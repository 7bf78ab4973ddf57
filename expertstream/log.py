"""Logging behind one `get_logger(__name__)`."""

from __future__ import annotations

import logging
import os


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(name)


def setup_logging(level: str | None = None) -> None:
    level = level or os.environ.get("EXPERTSTREAM_LOG_LEVEL", "INFO")
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
