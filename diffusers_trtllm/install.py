"""``enable_trtllm_attention``: install the right processor on every transformer of a pipeline, and undo it."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Mapping

import torch

from .calibration.curve import SkipCalibration
from .config import AttentionConfig
from .errors import AttentionConfigError
from .processors import PROCESSORS, processor_class_for
from .session import AttentionSession
from .stats import AttentionStats

logger = logging.getLogger("diffusers_trtllm")

TRANSFORMER_COMPONENTS = ("transformer", "transformer_2")


@dataclass
class TrtllmAttentionHandle:
    """What :func:`enable_trtllm_attention` returns: the pipeline's session (timestep, statistics) and the way back.

    Use as a context manager or call :meth:`restore` to put the original processors back and remove the hooks.
    """

    session: AttentionSession
    _originals: dict = field(default_factory=dict, repr=False)
    _hooks: list = field(default_factory=list, repr=False)

    @property
    def stats(self) -> AttentionStats:
        return self.session.stats

    @property
    def components(self) -> tuple[str, ...]:
        return tuple(self._originals)

    def restore(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for transformer, processors in self._originals.values():
            transformer.set_attn_processor(processors)
        self._originals.clear()

    def __enter__(self) -> "TrtllmAttentionHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


def pipeline_transformers(pipe) -> dict[str, torch.nn.Module]:
    """The pipeline's transformer components that are present (``transformer_2`` may be None)."""
    found = {name: getattr(pipe, name, None) for name in TRANSFORMER_COMPONENTS}
    return {name: module for name, module in found.items() if module is not None}


def enable_trtllm_attention(pipe, config: AttentionConfig | Mapping | str | None = None, *,
                            calibrations: Mapping[str, SkipCalibration] | None = None,
                            collect_stats: bool = True) -> TrtllmAttentionHandle:
    """Install this package's processor on ``pipe.transformer`` (and ``pipe.transformer_2``) with one session.

    Each attention layer gets its own light processor that knows its component and layer name; all share the
    session, which reads the timestep on every transformer call (normalized by the scheduler's
    ``num_train_timesteps``) and collects statistics. ``calibrations`` maps a component name to its
    Skip-Softmax curve; components whose ``config.json`` carries a ``sparse_attention_config`` are read too.
    Processors of attention modules the model's processor does not serve (HunyuanVideo 1.5's text refiner, for
    one) are left as they are.
    """
    transformers = pipeline_transformers(pipe)
    if not transformers:
        raise AttentionConfigError(f"{type(pipe).__name__} has no 'transformer' component to install attention on")
    scheduler = getattr(pipe, "scheduler", None)
    num_train = getattr(getattr(scheduler, "config", None), "num_train_timesteps", None)
    if num_train is None:
        num_train = 1000
        logger.warning("pipeline scheduler has no config.num_train_timesteps; normalizing timesteps by 1000")
    session = AttentionSession(config, _merge_calibrations(transformers, calibrations),
                               num_train_timesteps=num_train, collect_stats=collect_stats)
    handle = TrtllmAttentionHandle(session)
    sites = []
    try:
        for component, transformer in transformers.items():
            sites += _install(handle, component, transformer)
        session.resolved = session.config.resolve_sites(sites)
        _check_calibrations(session, sites)
    except Exception:
        handle.restore()
        raise
    return handle


def _install(handle: TrtllmAttentionHandle, component: str, transformer) -> list[tuple[str, str, str, str]]:
    cls = processor_class_for(transformer)
    if cls is None:
        supported = sorted(name for p in PROCESSORS for name in p.TRANSFORMER_CLASSES)
        raise AttentionConfigError(
            f"{component} is a {type(transformer).__name__}; diffusers_trtllm has processors for {supported}")
    if getattr(transformer, "_parallel_config", None) is not None:
        raise NotImplementedError(f"{component} has context parallelism enabled; {cls.__name__} does not "
                                  "implement it, and ignoring it would give wrong output")
    session = handle.session
    originals = transformer.attn_processors
    modules = dict(transformer.named_modules())
    processors, sites = {}, []
    for key, original in originals.items():
        layer = key.removesuffix(".processor")
        if cls.serves(modules[layer]):
            processors[key] = cls(session=session, component=component, layer=layer)
            sites += [(component, layer, role, category) for role, category in cls.ROLES.items()]
        else:
            processors[key] = original
    transformer.set_attn_processor(processors)
    handle._originals[component] = (transformer, originals)
    handle._hooks.append(session.timestep_hook(transformer, cls.read_timestep))
    session.register_layers(component, transformer)
    return sites


def _merge_calibrations(transformers, explicit) -> dict[str, SkipCalibration]:
    from .calibration import calibrations_from_transformers

    return calibrations_from_transformers(transformers, explicit)


def _check_calibrations(session: AttentionSession, sites) -> None:
    """Fail at install time, not mid-generation, when a target_sparsity spec meets an uncalibrated component."""
    for (component, layer, _, _), (_, spec) in session.resolved.items():
        if spec.skip_softmax is not None and spec.skip_softmax.target_sparsity is not None \
                and component not in session.calibrations:
            raise AttentionConfigError(
                f"skip_softmax.target_sparsity={spec.skip_softmax.target_sparsity} applies to {component}.{layer} "
                f"but {component!r} has no Skip-Softmax calibration: load a calibrated checkpoint, run "
                "diffusers_trtllm.calibrate(pipe, prompts), pass calibrations={...}, or set "
                "skip_softmax.threshold (λ) instead")
