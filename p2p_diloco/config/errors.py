"""The one error every config raises: a value a person must fix, and the check that raises it."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value a person must fix; the message says which and why."""


def require(ok: bool, message: str) -> None:
    """Raise ConfigError(message) unless `ok`: every `validate()` in config/ states its rules with it."""
    if not ok:
        raise ConfigError(message)
