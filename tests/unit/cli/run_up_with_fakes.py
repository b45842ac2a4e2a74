"""Run `maskwire up` with fake_service.py standing in for the real services (for test_up.py)."""

from __future__ import annotations

import sys

from maskwire import up
from maskwire.cli import main

# Run from the repository root (as test_up.py does), which the children inherit.
up.SERVICE_COMMAND = [sys.executable, "-m", "tests.unit.cli.fake_service"]
up.RESTART_BACKOFF_S = (0.1, 0.2)  # the policy's shape at test speed
sys.exit(main(["up", *sys.argv[1:]]))
