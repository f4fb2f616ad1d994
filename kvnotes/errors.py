"""Errors that mean "this input cannot run", raised before any heavy work, each with a message
that says what is valid. Front ends (the runner, the `kvnotes` command) print them as one
`error:` line instead of a traceback.

Every error kvnotes raises on purpose is a `KvnotesError`, so `except kvnotes.KvnotesError` catches
anything kvnotes refused; each also keeps the built-in base a Python user expects:

    KvnotesError
      ConfigError (ValueError)          a setting, argument or input that cannot run
        MissingDependency               a package this path needs is not installed
        PairError                       a prompt pair that cannot be patched position by position
      EditError (ValueError)            an edit EditableCache cannot make
      AlignmentError, DecisionTokenError, LocomoFormatError (ValueError)   task items
      UnknownModelError, UnknownSuiteError (KeyError)                       names not registered
      StoreError (ValueError), BlockMismatchError, BlockDamagedError        the block store
      WeightsError, MemoryBudgetError, NoGoError (RuntimeError)             weights, memory, verify
      UnsupportedRopeError (NotImplementedError)                            a rope type not handled
"""

from __future__ import annotations

import importlib.util


class KvnotesError(Exception):
    """Anything kvnotes refused: the base of every error it raises on purpose."""


class ConfigError(KvnotesError, ValueError):
    """A configuration that cannot run; the message says what is valid."""


class UnusablePairWarning(UserWarning):
    """A prompt pair whose metric barely moves between its prompts (|delta| below the margin):
    its recoveries are reported as NaN."""


class MissingDependency(ConfigError):
    """A package that this path needs is not installed; the message names it and the install command."""


def require(module: str, why: str, install: str | None = None) -> None:
    """Raise `MissingDependency` when `module` cannot be imported, before any heavy work.

    `why` says what needs it ("converting a GGUF file"); `install` is the command that brings it
    (default `pip install <module>`)."""
    if importlib.util.find_spec(module) is None:
        cmd = install or f"pip install {module}"
        raise MissingDependency(f"{why} needs the package {module!r}, which is not installed: "
                                f"run `{cmd}`")
