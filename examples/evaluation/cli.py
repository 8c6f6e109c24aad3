"""The examples' command-line conventions: a bad flag, configuration value, shape, device, model or missing
package is one line on stderr and exit status 2 (argparse's ``parser.error``), found before any expensive work
where it can be (a shape or backend the model or device cannot take before the model is built; a setting that
needs the model itself, such as a target sparsity without a calibration, right after it is built, before the
first video); warnings print as one line without the library's file paths."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import warnings
from pathlib import Path
from typing import Iterator, Sequence

import torch

from diffusers_trtllm import AttentionConfig, AttentionConfigError, BackendUnavailableError, enable_trtllm_attention
from diffusers_trtllm.backends.base import TRTLLM_ON_REFERENCE_ENV
from diffusers_trtllm.backends.trtllm import device_unavailable_reason
from diffusers_trtllm.calibration import CalibrationError
from diffusers_trtllm.config import TRTLLM_ATTN, env_switch

from .models import ModelEntry, ModelLoadError, VideoShape

#: what a user can get wrong on the command line; anything else is a bug and keeps its traceback
USER_ERRORS = (AttentionConfigError, BackendUnavailableError, CalibrationError, ModelLoadError)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line (argparse prints its usage first): ``prog: error: message``
    on stderr, exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (``--steps 0`` would otherwise run the pipeline's default)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is invalid: expected an integer >= 1")
    return value


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(parser: argparse.ArgumentParser, device: str) -> torch.device:
    """``device`` as a torch device that exists here, or ``parser.error``."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError) as e:
        parser.error(f"--device {device!r} is invalid: {e}")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {device}: this torch ({torch.__version__}) sees no CUDA GPU; use --device cpu")
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        parser.error(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) here")
    return parsed


def check_backends(parser: argparse.ArgumentParser, configs: list[AttentionConfig], device: torch.device) -> None:
    """Refuse, before any work, a configuration that names TRTLLM_ATTN on a device without its kernels (the
    library would only find out at the first attention call)."""
    named = any(spec.backend == TRTLLM_ATTN for config in configs
                for spec in (config.default, *config.per_role.values()))
    if named and not env_switch(TRTLLM_ON_REFERENCE_ENV):
        reason = device_unavailable_reason(device)
        if reason is not None:
            parser.error(f"{reason}; on this machine use TORCH_SDPA, TORCH_REFERENCE or auto")


def require_packages(parser: argparse.ArgumentParser, purpose: str, *modules: str) -> None:
    """``parser.error`` naming the install command when one of ``modules`` is not installed."""
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        parser.error(f"{purpose} needs {', '.join(missing)}: pip install -e \".[examples]\" (from the repository "
                     "root)")


@contextlib.contextmanager
def user_errors(parser: argparse.ArgumentParser) -> Iterator[None]:
    """Turn :data:`USER_ERRORS` raised inside into ``parser.error`` (the first line of the message)."""
    try:
        yield
    except USER_ERRORS as e:
        parser.error(str(e).strip().splitlines()[0])


def check_output(parser: argparse.ArgumentParser, flag: str, path: Path, *, folder: bool) -> None:
    """``parser.error`` before any work when ``path`` (a file to write, or with ``folder`` a folder to write into)
    cannot be written: an existing folder where a file goes (or a file where a folder goes), a file on the way to
    it, the nearest existing folder not writable. Nothing is made here: the script makes the folder when it
    writes."""
    if path.exists() and path.is_dir() != folder:
        parser.error(f"{flag} {path} is an existing {'file' if folder else 'folder'}; give a "
                     f"{'folder' if folder else 'file path'}")
    existing = path if folder and path.is_dir() else path.parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        parser.error(f"{flag} {path}: cannot make a folder under {existing}, which is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        parser.error(f"{flag} {path}: the folder {existing} is not writable")


def check_shape(parser: argparse.ArgumentParser, entry: ModelEntry, shape: VideoShape) -> None:
    """``parser.error`` when ``entry``'s model cannot take ``shape`` (its :class:`~.shapes.ShapeRule`)."""
    problem = entry.shape_rule.problem(entry.name, shape.height, shape.width, shape.frames)
    if problem is not None:
        parser.error(problem)


def check_installs(parser: argparse.ArgumentParser, pipe, configs: Sequence[AttentionConfig]) -> None:
    """Install each configuration on ``pipe`` and take it off again, so that what only the model can tell (a
    target sparsity on a transformer without a calibration, a backend that cannot run one of its layers) is
    refused before the first video rather than in the middle of a run."""
    with user_errors(parser):
        for config in configs:
            with enable_trtllm_attention(pipe, config):  # with statistics: the accuracy probe needs them
                pass


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    return f"{category.__name__}: {message}\n"


def plain_warnings() -> None:
    """Print warnings as ``Category: message``: the library file and source line Python adds say nothing to a
    user of the examples."""
    warnings.formatwarning = _one_line_warning
