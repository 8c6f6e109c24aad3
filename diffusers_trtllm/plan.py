"""What runs for each attention call site, decided off the per-call path.

At install, :class:`CallPlanner` resolves every call site's spec (component, layer, role) and chooses its
backend for the GPU the pipeline will run on: an explicit backend that cannot run a site's attention (causal,
head_dim, dtype, GPU) raises then, with the fix in the message; ``auto`` that cannot keep Skip-Softmax or SAGE
warns once, naming the roles. Once per denoising step, :meth:`CallPlanner.plan_step` turns the timestep gate and
λ (or the calibrated factor), the SAGE step schedule, the accuracy guard's decisions and the probe's steps into
each site's row of the run's ``settings``, a CPU tensor the attention op reads (a run is one pipeline call:
:mod:`~diffusers_trtllm.run_state`); nothing on the per-call path looks at Python state that changes during a
run. At the end of a probed step, :meth:`CallPlanner.guard` reads the probed errors and takes SAGE (else
skipping) away from a layer above its bound for the rest of the run.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from .backends import planned_route, select_backend
from .backends.trtllm import sage_semantics
from .backends.base import DEFAULT_TILE, KernelPlan, VarlenQKV, dense_kernel_of, get_backend
from .calibration.curve import SkipCalibration
from .config import (AUTO, TORCH_REFERENCE, TRTLLM_ATTN, AccuracySpec, AttentionConfig, AttentionSpec, AttnQuantSpec,
                     SkipSoftmaxSpec)
from .errors import AttentionConfigError, BackendUnavailableError, warn_once, warn_user
from .ops import encode_quant
from .run_state import OWNER, REUSE, REUSE_FRESH, REUSE_KEEP, REUSE_OFF, SAGE, SKIP, Run, RunKey, initial_settings


@dataclass(frozen=True)
class CallSite:
    """One attention call site: component (``transformer_2``), layer (``blocks.3.attn1``), role, category."""

    component: str
    layer: str
    role: str
    category: str

    @property
    def qualified_layer(self) -> str:
        return f"{self.component}.{self.layer}"


@dataclass(frozen=True)
class RoleTraits:
    """What a model's attention role is: causal or not, whether Skip-Softmax / SAGE may apply to it, and whether
    its queries outnumber its keys (video queries on a text sequence), which decides the Hopper SAGE kernel."""

    category: str
    causal: bool = False
    sparse_ok: bool = True
    quant_ok: bool = True
    queries_outnumber_keys: bool = False
    #: its attention runs under diffusers' context parallelism (diffusers keeps Wan's cross-attention out of it)
    context_parallel: bool = True


@dataclass(frozen=True)
class HeadLayout:
    """Query heads, key/value heads and head_dim of one attention module."""

    heads_q: int
    heads_kv: int
    head_dim: int


@dataclass(eq=False)
class AttentionCall:
    """How one call site runs: what a processor hands to the attention op with every call of its role. Fixed at
    install; what changes per run and step (settings, counters, the guard's decisions) is the run's, found by
    ``owner`` (the handle's :class:`~diffusers_trtllm.run_state.RunKey`) and ``index`` (this site's row)."""

    site: CallSite
    backend: str
    causal: bool
    quant: AttnQuantSpec | None
    skip: SkipSoftmaxSpec | None
    calibration: SkipCalibration | None = None
    tile: tuple[int, int] = DEFAULT_TILE
    dropped: str = ""
    #: the backend was chosen for this site at install (else the op checks or chooses it at the first call)
    planned: bool = True
    #: the kernel route the op runs (``backend``, or the test seam's route chosen at install); "" = ``backend``
    route: str = ""
    #: what runs outside a run (planned at no timestep: skip value, SAGE switch, probe rows), then ``owner``'s
    #: key and ``index`` (``run_state.OWNER``, ``run_state.SITE``): what the op reads
    settings: torch.Tensor = field(default_factory=initial_settings)
    #: the runs this call reads (its handle's key, also in ``settings``) and its row in them
    owner: RunKey | None = None
    index: int = 0
    #: runs count this site's calls in their statistics (statistics are on)
    counting: bool = False
    #: the spec's Skip-Softmax even where ``auto`` dropped it: what a calibration probe counts.
    requested_skip: SkipSoftmaxSpec | None = None
    #: calibration only (eager): a step's calls that would skip go to ``probe`` and then run dense.
    probe: Callable | None = None
    #: the accuracy probe and guard (the op adds ``[Σ error², Σ exact²]`` to the run's sums)
    accuracy: AccuracySpec | None = None

    #: the op's arguments derived from the above, computed once (not on the traced path)
    quant_arg: str = field(init=False)
    per_kv_len: bool = field(init=False)
    #: the Hopper dense kernel the route names ("" where the backend has one): what dense steps run
    dense_kernel: str = field(init=False)

    def __setstate__(self, state):
        # a copy (deepcopy, pickle) of an installed call belongs to the copy's handle: its RunKey is new
        self.__dict__.update(state)
        if self.owner is not None:
            self.settings[OWNER] = float(self.owner.value)

    def __post_init__(self):
        self.route = self.route or self.backend
        self.dense_kernel = dense_kernel_of(self.route)
        self.quant_arg = encode_quant(self.quant)
        # λ is given (``threshold``): the op multiplies it by the call's longest key length.
        self.per_kv_len = self.skip is not None and self.skip.threshold is not None

    @property
    def skip_value(self) -> torch.Tensor:
        """The skip value outside a run (a 0-dim view of ``settings``)."""
        return self.settings[SKIP]

    @property
    def skips_somewhere(self) -> bool:
        """Some step of a run can skip here (a calibration's ``ignore`` keeps its layers dense at every step)."""
        if self.skip is None or not self.skip.skips:
            return False
        return self.skip.threshold is not None or self.calibration is None or \
            not self.calibration.keeps_dense(self.site.layer)

    @property
    def probed(self) -> bool:
        """The accuracy probe is on for this site (it needs the site's statistics)."""
        return self.accuracy is not None and self.counting

    @classmethod
    def unplanned(cls, site: CallSite, backend: str, causal: bool, quant: AttnQuantSpec | None,
                  skip: SkipSoftmaxSpec | None, accuracy: AccuracySpec | None = None) -> "AttentionCall":
        """A call not planned at install (its backend is checked or chosen by the op at the first call), with no
        timestep: its skip value is set once, here. The SAGE step schedule and the accuracy probe need a
        pipeline's steps and statistics: refused."""
        if accuracy is not None or (quant is not None and quant.scheduled):
            what = "accuracy (the probe and guard)" if accuracy is not None else \
                "quant.disabled_until_timestep / disabled_below_timestep (the SAGE step schedule)"
            raise AttentionConfigError(
                f"{site.role}: {what} needs the pipeline's steps and statistics, which a processor or the 'trtllm' "
                "dispatcher backend alone does not see: install with diffusers_trtllm.enable_trtllm_attention(pipe, "
                "config), or remove it")
        call = cls(site, backend, causal, quant, skip, planned=False)
        call.skip_value.fill_(call.step_value(None))
        return call

    def mode(self, skipping: bool, quantized: bool | None = None, reusing: bool = False) -> str:
        """Short name of what runs: ``dense``, ``skip``, ``sage-int8``, ``sage-fp8_e4m3+skip``,
        ``sage-fp8_e4m3+skip+reuse`` (a step reusing tile maps)... (``quantized``: whether SAGE runs; None:
        whenever the call has it); ``dense[flash_attn4]`` names Hopper's dense kernel."""
        quantized = self.quant is not None if quantized is None else quantized and self.quant is not None
        parts = [f"sage-{self.quant.dtype_qk}"] if quantized else []
        parts += (["skip"] if skipping else []) + (["reuse"] if skipping and reusing else [])
        return "+".join(parts) or (f"dense[{self.dense_kernel}]" if self.dense_kernel else "dense")

    def mode_of(self, row) -> str:
        """What a settings row runs."""
        return self.mode(bool(row[SKIP]), bool(row[SAGE]), row[REUSE] == REUSE_KEEP)

    @property
    def reuse_steps(self) -> int:
        """Steps a Skip-Softmax tile map is reused after the step that made it (0: no reuse)."""
        return self.skip.reuse_steps if self.skip is not None else 0

    @property
    def reuse_tests(self) -> bool:
        """Whether a step reusing a tile map tests the tiles the map does not hold (``skip_softmax.reuse_test``)."""
        return self.skip is None or self.skip.reuse_test

    def plan_row(self, timestep: float | None, step: int, dropped: set = frozenset()) -> tuple[list[float], bool]:
        """The settings row for step ``step`` at normalized ``timestep`` (skip value and SAGE as the gates and the
        guard's ``dropped`` allow, probe rows at probed steps, tile maps kept where skipping reuses them: made
        afresh, the run decides when to reuse them), and whether the step is probed."""
        skip = 0.0 if "skip" in dropped else self.step_value(timestep)
        sage = self.quant is not None and "sage" not in dropped and self.quant.runs_at(timestep)
        probed = self.probed and self.accuracy.probes(step)
        rows = self.accuracy.probe_rows if probed else 0
        reuse = REUSE_FRESH if skip and self.reuse_steps and "reuse" not in dropped else REUSE_OFF
        return [skip, float(sage), float(rows), reuse], probed

    def step_value(self, timestep: float | None, skip: SkipSoftmaxSpec | None = None) -> float:
        """The skip value for a step at normalized ``timestep`` (None: no timestep known)."""
        skip = self.skip if skip is None else skip
        if skip is None or not skip.skips:
            return 0.0
        if skip.disabled_until_timestep > 0.0 and (timestep is None or timestep > skip.disabled_until_timestep):
            return 0.0
        if skip.threshold is not None:
            return skip.threshold
        if self.calibration is None:
            return 1.0  # a probed target_sparsity without calibration: counted, never run
        if self.calibration.keeps_dense(self.site.layer):
            return 0.0
        return self.calibration.factor(skip.target_sparsity)


class CallPlanner:
    """Every call site of a pipeline's transformers and how each runs.

    Skip-Softmax calibration hands the calls that would skip to a probe: :meth:`set_probe`.
    """

    def __init__(self, config: AttentionConfig, calibrations: Mapping[str, SkipCalibration] | None = None, *,
                 collect_stats: bool = True):
        self.config = config
        self.calibrations = dict(calibrations or {})
        self.collect_stats = collect_stats
        self.calls: dict[CallSite, AttentionCall] = {}
        self.layouts: dict[CallSite, HeadLayout] = {}
        self.traits: dict[CallSite, RoleTraits] = {}
        #: the key of this planner's runs (a deep copy or unpickled planner gets its own)
        self.run_key = RunKey()
        self.device = torch.device("cpu")
        self._warned: set[str] = set()

    # --- install time -------------------------------------------------------------------------------------------
    def add_site(self, site: CallSite, traits: RoleTraits, layout: HeadLayout) -> None:
        self.traits[site] = traits
        self.layouts[site] = layout

    def choose_backends(self, device: torch.device, dtype: torch.dtype) -> None:
        """Resolve every site's spec and backend for ``device`` / ``dtype`` (at install, before the processors
        take their calls); raise for an explicit choice that cannot run, warn once for what ``auto`` drops."""
        resolved = self.config.resolve_sites([(s.component, s.layer, s.role, s.category) for s in self.traits])
        dropped: dict[str, list[str]] = {}
        calls = {}
        for site, traits in self.traits.items():
            key, spec = resolved[(site.component, site.layer, site.role, site.category)]
            call = self._plan_site(site, traits, key, spec, device, dtype)
            if call.dropped:
                dropped.setdefault(call.dropped, []).append(site.role)
            calls[site] = call
        self.calls = calls
        for why, roles in dropped.items():
            self.warn_once(f"dropped-{why}", f"diffusers_trtllm: auto runs {sorted(set(roles))} attention dense: "
                                             f"{why}")
        for note in self._sampled_skipping_notes(calls.values(), self.traits, device):
            warn_once(note)  # a note that holds for every install: once per process
        for index, call in enumerate(calls.values()):
            call.owner, call.index = self.run_key, index
            row = call.plan_row(None, 0)[0] + [float(self.run_key.value), float(index)]
            call.settings.copy_(torch.tensor(row, dtype=torch.float64))
        self._check_statistics()
        self.device = device

    def _plan_site(self, site: CallSite, traits: RoleTraits, key: str, spec: AttentionSpec,
                   device: torch.device, dtype: torch.dtype) -> AttentionCall:
        skip = spec.skip_softmax if traits.sparse_ok and spec.skips else None
        quant = spec.quant if traits.quant_ok else None
        calibration = None
        if skip is not None and skip.target_sparsity is not None:
            calibration = self._calibration_for(site, skip)
        layout = self.layouts[site]
        probe = torch.empty(1, layout.heads_q, layout.head_dim, device=device, dtype=dtype)
        probe_kv = torch.empty(1, layout.heads_kv, layout.head_dim, device=device, dtype=dtype)
        # The skip factor's value does not change what can run, only whether it skips: plan with "skips".
        kernel = KernelPlan(backend=spec.backend, scale=layout.head_dim ** -0.5, causal=traits.causal,
                            skip_factor=1.0 if skip is not None else 0.0, quant=quant,
                            reuse=skip is not None and skip.reuse_steps > 0)
        qkv = VarlenQKV(probe, probe_kv, probe_kv, (1,), (1,))
        try:
            choice = select_backend(spec.backend, kernel, qkv)
        except BackendUnavailableError as e:
            non_causal = KernelPlan(backend=spec.backend, scale=kernel.scale)
            # A dense causal role (Cosmos 3's text stream) left to a default that runs non-causal attention only
            # (TRTLLM_ATTN) runs on what auto picks for it, said once: vLLM-Omni's config parser drops a per_role
            # "auto" entry, so asking users to add one would leave them no fix there. A per_role backend for the
            # role is an explicit choice and raises.
            if not (key == "default" and traits.causal and skip is None and quant is None and spec.backend != AUTO
                    and get_backend(spec.backend).unavailable_reason(non_causal, qkv) is None):
                fix = "TORCH_SDPA" if traits.causal else AUTO
                raise BackendUnavailableError(
                    f"{site.qualified_layer} ({site.role} attention, per_role key {key!r}): {e}. Fix: give this "
                    f"role a backend that runs it, e.g. per_role {{{site.role!r}: {{\"backend\": \"{fix}\"}}}}"
                ) from None
            choice = select_backend(AUTO, kernel, qkv)
            self.warn_once(f"causal-default-{site.role}", (
                f"diffusers_trtllm: {site.role!r} attention is causal and the default backend {spec.backend} runs "
                f"non-causal attention only, so {site.role!r} runs dense on {choice.name}; a per_role entry for "
                f"{site.role!r} chooses its backend instead"))
        requested_skip = skip
        if choice.reuse_dropped:
            skip = dataclasses.replace(skip, reuse_steps=0)
        elif choice.dropped:
            skip, quant, calibration = None, None, None
        try:
            route = planned_route(choice, device, spec.dense_kernel)
        except BackendUnavailableError as e:
            raise BackendUnavailableError(
                f"{site.qualified_layer} ({site.role} attention, per_role key {key!r}): {e}") from None
        if quant is not None and (quant.scheduled or (spec.accuracy is not None and spec.accuracy.max_error)):
            # the SAGE step schedule and the guard run this site dense at some steps: that must run here too
            dense = KernelPlan(backend=choice.name, scale=kernel.scale, causal=traits.causal,
                               skip_factor=kernel.skip_factor, reuse=skip is not None and skip.reuse_steps > 0)
            reason = get_backend(choice.name).unavailable_reason(dense, qkv)
            if reason is not None:
                raise BackendUnavailableError(
                    f"{site.qualified_layer} ({site.role} attention, per_role key {key!r}): the SAGE step schedule "
                    f"or accuracy guard runs it without SAGE at some steps, which {choice.name} cannot run here: "
                    f"{reason}")
        return AttentionCall(site, choice.name, traits.causal, quant, skip, calibration, dropped=choice.dropped,
                             route=route, requested_skip=requested_skip, accuracy=spec.accuracy)

    def _calibration_for(self, site: CallSite, skip: SkipSoftmaxSpec) -> SkipCalibration:
        calibration = self.calibrations.get(site.component)
        if calibration is None:
            raise AttentionConfigError(
                f"skip_softmax.target_sparsity={skip.target_sparsity} applies to {site.qualified_layer} but "
                f"{site.component!r} has no Skip-Softmax calibration: load a calibrated checkpoint (its config.json "
                "carries 'sparse_attention_config'), run diffusers_trtllm.calibrate(pipe, prompts, ...), pass "
                "calibrations={...}, or set skip_softmax.threshold (λ) instead")
        # reusing steps that test nothing skip what the step that made the map skipped: the curve without reuse
        curve_reuse = skip.reuse_steps if skip.reuse_test else 0
        if (calibration.reuse_steps or 0) != curve_reuse:
            self.warn_once(f"reuse-{site.component}", (
                f"skip_softmax.reuse_steps={skip.reuse_steps} (reuse_test={skip.reuse_test}) but "
                f"{site.component!r}'s Skip-Softmax curve was calibrated with reuse_steps="
                f"{calibration.reuse_steps or 0}: target_sparsity {skip.target_sparsity} lands off that curve; "
                f"calibrate with reuse_steps={curve_reuse} (calibrate(..., reuse_steps=...))"))
        observed = calibration.sparsity_range
        if observed is not None and not observed[0] <= skip.target_sparsity <= observed[1]:
            self.warn_once(f"extrapolate-{site.component}", (
                f"skip_softmax.target_sparsity={skip.target_sparsity} lies outside the sparsity range "
                f"[{observed[0]:.2f}, {observed[1]:.2f}] observed when {site.component!r} was calibrated; its "
                "factor is extrapolated"))
        return calibration

    @staticmethod
    def _sampled_skipping_notes(calls, traits: Mapping[CallSite, RoleTraits], device: torch.device) -> list[str]:
        """Which roles skip only in the heads where skipping pays (the Triton SAGE kernel's rule, which the
        reference follows on a CPU): with little to skip, those heads run dense instead of skipping."""
        sampled = {}
        for call in calls:
            if call.skip is None or call.quant is None or call.backend not in (TRTLLM_ATTN, TORCH_REFERENCE):
                continue
            # only whether queries outnumber keys picks the kernel, not the lengths themselves
            lengths = ((2,), (1,)) if traits[call.site].queries_outnumber_keys else ((1,), (1,))
            rule = sage_semantics(call.quant, device, *lengths).skip_sample
            if rule is not None:
                sampled.setdefault(rule[1], []).append(call.site.role)
        where = "the Triton SAGE kernel" if device.type == "cuda" else "the Triton SAGE kernel's rule"
        return [f"diffusers_trtllm: {sorted(set(roles))} SAGE + Skip-Softmax follows {where}: a head skips only "
                f"where a sample of its query tiles skipped >= {pays_from:.0%} of its KV tiles (dense elsewhere); "
                "handle.stats counts what was skipped"
                for pays_from, roles in sampled.items()]

    def _check_statistics(self) -> None:
        probed = [call.site.qualified_layer for call in self.calls.values() if call.accuracy is not None]
        if probed and not self.collect_stats:
            raise AttentionConfigError(
                f"accuracy (the probe) is set for {len(probed)} layers (e.g. {probed[0]}) but collect_stats=False: "
                "the probe reports its errors in handle.stats; install with collect_stats=True or remove accuracy")
        for call in self.calls.values():
            call.counting = self.collect_stats

    # --- once per run and denoising step --------------------------------------------------------------------------
    def new_run(self) -> Run:
        """A run's state: zeroed counters, nothing taken away by the guard, step 0 planned at no timestep."""
        run = Run.start(self.run_key.value, self.calls.values(), self.device, self.collect_stats)
        self.plan_step(run, None, 0)
        return run

    def plan_step(self, run: Run, timestep: float | None, step: int) -> None:
        """Set every site's row of ``run.settings`` for step ``step`` at normalized ``timestep`` (in place: no
        recompile)."""
        run.timestep, run.step = timestep, step
        rows = []
        for i, call in enumerate(run.calls):
            row, run.step_probed[i] = call.plan_row(timestep, step, run.guard_dropped[i])
            row[REUSE] = self._reuse(run, i, call, row)
            rows.append(row)
            run.probing[i] = call.probe is not None and call.step_value(timestep, call.requested_skip) > 0.0
        if rows:
            run.settings.copy_(torch.tensor(rows, dtype=torch.float64))

    @staticmethod
    def _reuse(run: Run, index: int, call: AttentionCall, row: list[float]) -> float:
        """Site ``index``'s ``[REUSE]`` for the step planned in ``row``, after counting the step that ended: its
        maps are reused for ``call.reuse_steps`` steps after the step that made them, while the site runs the same
        mode (the timestep gate, the SAGE schedule and the guard change modes); a step the site was not called
        in counts for nothing."""
        planned, sage, age = run.reuse_state[index]
        if run.step_calls[index]:
            age = 0 if planned == REUSE_FRESH else age + 1 if planned == REUSE_KEEP else None
        run.step_calls[index] = 0
        if row[REUSE] == REUSE_OFF:
            run.drop_tile_maps(index)
            age = None
        reuse = (REUSE_OFF if row[REUSE] == REUSE_OFF else
                 REUSE_KEEP if age is not None and sage == row[SAGE] and age < call.reuse_steps else REUSE_FRESH)
        run.reuse_state[index] = (reuse, row[SAGE] if reuse == REUSE_FRESH else sage, age)
        return reuse

    @staticmethod
    def guarding(run: Run) -> bool:
        """Whether this step is probed at a site with a guard (the run then reads the errors at its end)."""
        return any(probed and call.accuracy.max_error for call, probed in zip(run.calls, run.step_probed))

    @staticmethod
    def guard(run: Run, step: int, errors: Mapping[int, tuple[float, float]]) -> None:
        """The guard at the end of probed step ``step`` (``errors``: each probed site's ``(Σ error², Σ exact²)``
        in it, by site index): a site above its ``accuracy.max_error`` loses, for the rest of the run, the reuse of
        tile maps where the step reused them, else SAGE, else skipping (its settings change at the next
        :meth:`plan_step`), with a warning."""
        for index, (error_sq, exact_sq) in errors.items():
            call, dropped, row = run.calls[index], run.guard_dropped[index], run.settings[index]
            bound = call.accuracy.max_error if call.accuracy is not None else None
            if not bound or not run.step_probed[index] or not exact_sq:
                continue
            error = math.sqrt(error_sq / exact_sq)
            if error <= bound:
                continue
            mode = call.mode_of(row)
            if row[REUSE] == REUSE_KEEP:
                drop, what = "reuse", "Skip-Softmax reuse"
            elif bool(row[SAGE]) and call.quant is not None:
                drop, what = "sage", "SAGE"
            elif bool(row[SKIP]):
                drop, what = "skip", "Skip-Softmax"
            elif "dense" in dropped:
                continue
            else:
                drop, what = "dense", ""
            dropped.add(drop)
            outcome = (f"it runs without {what} for the rest of this pipeline call" if what else
                       "it ran dense, so there is nothing to drop (reported once per pipeline call)")
            warn_user(
                f"diffusers_trtllm: {call.site.qualified_layer} ({call.site.role} attention, {mode}): probed error "
                f"{error:.3g} at step {step} exceeds the bound accuracy.max_error={bound:g}; {outcome}")

    def set_probe(self, probe: Callable | None) -> None:
        """Hand every call that would skip to ``probe(site, qkv, scale=, causal=, tile=, step=)`` and run it dense
        (Skip-Softmax calibration; eager runs only) from the next planned step on. ``None`` ends probing."""
        for call in self.calls.values():
            call.probe = probe

    # --- messages -------------------------------------------------------------------------------------------------
    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warn_user(message)
