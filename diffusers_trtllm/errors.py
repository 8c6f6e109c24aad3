"""Exceptions raised by diffusers_trtllm.

Both derive from the built-in exception a caller would already catch for the same mistake, so existing
``except ValueError`` / ``except RuntimeError`` handlers keep working.
"""


class AttentionConfigError(ValueError):
    """A configuration value is invalid. The message names the field, the value given and what is valid."""


class BackendUnavailableError(RuntimeError):
    """An explicitly chosen backend (or feature of it) cannot run here. The message says why."""


def invalid(field: str, value, valid: str) -> AttentionConfigError:
    """Build the error for ``field`` holding ``value`` where ``valid`` describes the accepted values."""
    return AttentionConfigError(f"{field}={value!r} is invalid: expected {valid}")


class CalibrationError(RuntimeError):
    """Calibration produced too little to fit a curve, or a curve is asked about where it was never measured.
    The message says what was observed and what to change."""


#: what :func:`warn_once` said so far in this process
_SAID: set = set()


def warn_once(message: str, key=None) -> None:
    """:func:`warn_user` the first time this process meets ``key`` (default: the message itself)."""
    key = message if key is None else key
    if key not in _SAID:
        _SAID.add(key)
        warn_user(message)


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` pointing at the user's line: the first frame outside this package, diffusers and torch
    and not generated code (a dataclass's ``__init__`` is ``<string>``): a warning raised while a pipeline runs
    or a config is built would otherwise name a line of theirs or ours."""
    import os
    import sys
    import warnings

    import diffusers
    import torch

    internal = tuple(os.path.dirname(module.__file__) + os.sep for module in (sys.modules[__package__], diffusers, torch))
    frame, level = sys._getframe(1), 2
    while frame is not None and (frame.f_code.co_filename.startswith(internal)
                                 or frame.f_code.co_filename.startswith("<")):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level if frame is not None else 2)
