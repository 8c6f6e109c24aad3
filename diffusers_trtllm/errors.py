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
