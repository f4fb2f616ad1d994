"""Errors that mean "this input cannot run", raised before any heavy work, each with a message
that says what is valid. Front ends (the runner, the `kvnotes` command) print them as one
`error:` line instead of a traceback."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration that cannot run; the message says what is valid."""
