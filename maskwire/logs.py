"""Logging setup shared by the services."""

from __future__ import annotations

import logging
import os


def setup_logging(level: str | None = None) -> None:
    """Configure root logging once: `--log-level` wins over `MASKWIRE_LOG_LEVEL` (default INFO)."""
    chosen = (level or os.environ.get("MASKWIRE_LOG_LEVEL") or "INFO").upper()
    logging.basicConfig(
        level=chosen,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def debug_payloads() -> bool:
    """Prompts and schemas appear in logs only when debug logging is asked for."""
    return logging.getLogger().isEnabledFor(logging.DEBUG)
