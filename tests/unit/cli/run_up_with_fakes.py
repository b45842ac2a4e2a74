"""Run `maskwire up` with fake_service.py standing in for the real services (for test_up.py)."""

from __future__ import annotations

import sys
from pathlib import Path

from maskwire import up
from maskwire.cli import main

up.SERVICE_COMMAND = [sys.executable, str(Path(__file__).with_name("fake_service.py"))]
up.RESTART_BACKOFF_S = (0.1, 0.2)  # the policy's shape at test speed
sys.exit(main(["up", *sys.argv[1:]]))
