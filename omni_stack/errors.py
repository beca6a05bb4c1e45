"""The errors of the stack library (omni_stack); the CLI turns them into exit statuses."""

from __future__ import annotations


class StackError(RuntimeError):
    """The stack could not be configured, started or stopped cleanly."""


class ConfigError(StackError):
    """A bad option value or config file; the message names the key."""


class StartAborted(StackError):
    """Stop was requested (Ctrl-C, SIGTERM) while the stack was starting."""
