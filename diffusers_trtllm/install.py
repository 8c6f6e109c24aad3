"""``enable_trtllm_attention``: plan and install this package's processors on a pipeline's transformers, and
undo it."""

from __future__ import annotations

import logging
from typing import Mapping

import torch

from .calibration import calibrations_from_transformers
from .calibration.curve import SkipCalibration
from .backends.base import backend_for_route
from .config import TORCH_REFERENCE, TRANSFORMER_COMPONENTS, TRTLLM_ATTN, AttentionConfig
from .errors import AttentionConfigError, BackendUnavailableError, warn_user
from .plan import CallPlanner, CallSite
from .processors import PROCESSORS, TrtllmAttnProcessor, processor_class_for
from .stats import AttentionStats
from .steps import RunTracker, attach, installed_tracker, num_train_timesteps

logger = logging.getLogger("diffusers_trtllm")


class TrtllmAttentionHandle:
    """What :func:`enable_trtllm_attention` returns: the plan, the runs, the statistics and the way back.

    ``stats``: what ran in the calling thread's current (or last) run (a pipeline call), else in the last run
    that ended in any thread. Use as a context manager or call :meth:`restore` (idempotent) to put back the
    processors it replaced and remove its hooks.
    """

    def __init__(self, planner: CallPlanner, tracker: RunTracker):
        self.planner = planner
        self.tracker = tracker
        self._installed: dict[str, tuple[torch.nn.Module, dict, dict]] = {}
        self._detach: list = []

    @property
    def stats(self) -> AttentionStats:
        run = self.tracker.stats_run()
        if run is None:
            return AttentionStats()
        if run.is_open:
            run.data["stats"].close_step(run.step)  # keep the counters of the step in progress
        return run.data["stats"]

    @property
    def components(self) -> tuple[str, ...]:
        return tuple(self._installed)

    def restore(self) -> None:
        """Put back the processors this handle replaced (only where its own processors still are) and remove its
        hooks: every transformer's attributes are as they were before install."""
        while self._detach:
            self._detach.pop()()
        for transformer, originals, ours in self._installed.values():
            current = transformer.attn_processors
            back = {name: originals[name] if current[name] is ours.get(name) else current[name] for name in current}
            transformer.set_attn_processor(back)
        self._installed.clear()

    def __enter__(self) -> "TrtllmAttentionHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


def pipeline_transformers(pipe) -> dict[str, torch.nn.Module]:
    """The pipeline's transformer components that are present (``transformer_2`` may be None); a bare
    transformer is its own ``transformer`` component. A transformer compiled whole before install
    (``torch.compile(transformer)``) is installed through: the module it compiled."""
    found = {"transformer": pipe} if isinstance(pipe, torch.nn.Module) else \
        {name: getattr(pipe, name, None) for name in TRANSFORMER_COMPONENTS}
    return {name: _compiled_module(module) for name, module in found.items() if module is not None}


def _compiled_module(module: torch.nn.Module) -> torch.nn.Module:
    return module._orig_mod if isinstance(module, torch._dynamo.eval_frame.OptimizedModule) else module


def plan_device(transformers) -> torch.device:
    """Where attention will run: the transformers' GPU, else this process's GPU, else the CPU."""
    for transformer in transformers:
        for parameter in transformer.parameters():
            if parameter.device.type == "cuda":
                return parameter.device
            break
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def enable_trtllm_attention(pipe, config: AttentionConfig | Mapping | str | None = None, *,
                            calibrations: Mapping[str, SkipCalibration] | None = None,
                            collect_stats: bool = True) -> TrtllmAttentionHandle:
    """Install this package's processor on every attention layer of ``pipe.transformer`` (and
    ``pipe.transformer_2``), or of a bare transformer.

    Everything that can be decided before running is decided here: each layer's spec (``config``'s per-role
    precedence), its backend on the GPU the pipeline runs on (an explicit backend that cannot run a layer's
    attention raises now; ``auto`` that must drop Skip-Softmax or SAGE warns once), the calibrations
    (``calibrations`` maps a component to its curve; components whose ``config.json`` carries a
    ``sparse_attention_config`` are read too). The timestep gate and λ are planned once per denoising step of
    each pipeline call, which is a run of its own (copies, ``from_pipe`` twins and threads each run their own);
    statistics keep the calling thread's current or last run. Install changes the transformers' processors and
    adds one removable hook and one forward pre-hook to each; the pipeline keeps its class. Install after moving
    the pipeline to its device and dtype. Context parallelism enabled before or after installing is honoured
    (Ulysses).
    """
    if not isinstance(pipe, torch.nn.Module) and not (callable(pipe) and hasattr(pipe, "__dict__")):
        raise AttentionConfigError(
            f"enable_trtllm_attention takes a diffusers pipeline (called as pipe(...)) or a transformer; got a "
            f"{type(pipe).__name__}: pass pipe.transformer to install on the transformer alone")
    transformers = pipeline_transformers(pipe)
    if not transformers:
        raise AttentionConfigError(f"{type(pipe).__name__} has no 'transformer' component to install attention on")
    for component, transformer in transformers.items():
        _refuse_reinstall(component, transformer)
    classes = {component: _processor_class(component, t) for component, t in transformers.items()}
    planner = CallPlanner(AttentionConfig.coerce(config), calibrations_from_transformers(transformers, calibrations),
                          collect_stats=collect_stats)
    for component, transformer in transformers.items():
        _add_sites(planner, component, transformer, classes[component])
    dtype = next(iter(transformers.values())).dtype
    planner.choose_backends(plan_device(transformers.values()), dtype)

    bare = isinstance(pipe, torch.nn.Module)
    tracker = RunTracker(planner, num_train_timesteps(None if bare else getattr(pipe, "scheduler", None)),
                         gated=_gated(planner))
    if bare and tracker.gated:
        warn_user("diffusers_trtllm: a timestep gate without a pipeline reads the transformer's timestep argument "
                  "on the host once per call; compile per block in this form")
    handle = TrtllmAttentionHandle(planner, tracker)
    try:
        for component, transformer in transformers.items():
            _install(handle, component, transformer, classes[component])
    except Exception:
        handle.restore()
        raise
    return handle


def context_parallel_plan(transformer: torch.nn.Module) -> dict:
    """The ``cp_plan`` for ``transformer.enable_parallelism(config=ContextParallelConfig(...), cp_plan=...)``, for
    every model this package serves: Wan's own ``_cp_plan`` from diffusers; for HunyuanVideo 1.5 (no plan in
    diffusers) this package's (video split, text whole on every rank); for Cosmos 3 (split outside its model in
    diffusers) an empty plan, after setting the transformer's ``_cp_shard_fn`` / ``_cp_gather_fn`` seams
    (generation stream padded and split, text whole). Use it with this package's processors, installed before or
    after ``enable_parallelism``: their key masks match these splits."""
    return _processor_class("transformer", _compiled_module(transformer)).context_parallel_plan(
        _compiled_module(transformer))


def _processor_class(component: str, transformer) -> type[TrtllmAttnProcessor]:
    cls = processor_class_for(transformer)
    if cls is None:
        supported = sorted(name for p in PROCESSORS for name in p.TRANSFORMER_CLASSES)
        raise AttentionConfigError(
            f"{component} is a {type(transformer).__name__}; diffusers_trtllm has processors for {supported} (any "
            "other diffusers model can use transformer.set_attention_backend('trtllm'))")
    return cls


def _refuse_reinstall(component: str, transformer) -> None:
    owned = installed_tracker(transformer) is not None
    ours = [n for n, p in transformer.attn_processors.items() if isinstance(p, TrtllmAttnProcessor)]
    if owned or ours:
        who = "the handle returned by enable_trtllm_attention" if owned else "transformer.set_attn_processor"
        raise AttentionConfigError(
            f"{component} already runs diffusers_trtllm processors (installed by {who}); call restore() on that "
            "handle (or put back the processors saved before: transformer.set_attn_processor(saved)) before "
            "installing again")


def _add_sites(planner: CallPlanner, component: str, transformer, cls: type[TrtllmAttnProcessor]) -> None:
    for name, module in transformer.named_modules():
        if cls.serves(module):
            for role in cls.roles_of(module):
                traits = cls.ROLES[role]
                planner.add_site(CallSite(component, name, role, traits.category), traits, cls.head_layout(module))


def _install(handle: TrtllmAttentionHandle, component: str, transformer, cls: type[TrtllmAttnProcessor]) -> None:
    originals = transformer.attn_processors
    modules = dict(transformer.named_modules())
    parallel = getattr(transformer, "_parallel_config", None)
    parallel = parallel if getattr(parallel, "context_parallel_config", None) is not None else None
    if parallel is not None and parallel.context_parallel_config.ring_degree > 1:
        _refuse_ring_without_lse(component, handle.planner, cls, parallel.context_parallel_config.ring_degree)
    processors, ours = {}, {}
    for key, original in originals.items():
        layer = key.removesuffix(".processor")
        module = modules[layer]
        if not cls.serves(module):
            processors[key] = original
            continue
        calls = {role: handle.planner.calls[CallSite(component, layer, role, cls.ROLES[role].category)]
                 for role in cls.roles_of(module)}
        processor = cls(calls=calls)
        if parallel is not None:
            processor._parallel_config = parallel
        processors[key] = ours[key] = processor
    transformer.set_attn_processor(processors)
    handle._installed[component] = (transformer, originals, ours)
    handle._detach.append(attach(handle.tracker, transformer, cls.TIMESTEP_ARGUMENTS))
    if ours:
        handle._detach += [hook.remove for hook in next(iter(ours.values())).install_hooks(transformer)]


def _refuse_ring_without_lse(component: str, planner: CallPlanner, cls: type[TrtllmAttnProcessor],
                             ring_degree: int) -> None:
    """Ring attention merges partial results by their log-sum-exp: a context-parallel site whose backend does not
    return it is refused now, naming one that does (context parallelism enabled after install: at the call)."""
    for site, call in planner.calls.items():
        if site.component == component and cls.ROLES[site.role].context_parallel and \
                not backend_for_route(call.route).returns_lse:
            raise BackendUnavailableError(
                f"{site.qualified_layer} ({site.role} attention) runs on {call.backend}, which does not return the "
                f"log-sum-exp that ring attention (ring_degree={ring_degree}) merges partial results by; give it "
                f"{TRTLLM_ATTN} or {TORCH_REFERENCE}, or use Ulysses (ulysses_degree) alone")


def _gated(planner: CallPlanner) -> bool:
    """Whether some site's settings follow the timestep (Skip-Softmax's gate, the SAGE step schedule)."""
    return any((c.skip is not None and c.skip.disabled_until_timestep > 0) or
               (c.quant is not None and c.quant.scheduled) for c in planner.calls.values())
