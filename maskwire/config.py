"""What every service's configuration shares: the error a flag check raises."""

from __future__ import annotations


class ConfigError(ValueError):
    """Flags that cannot work together or a value out of range; the message names the flag.
    Each service's `run` prints it (`maskwire <service>: ...`) and exits with status 2."""
