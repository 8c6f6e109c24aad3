"""What the user asked for: attention backend, Skip-Softmax and SAGE settings, per role.

The vocabulary is vLLM-Omni's ``TRTLLM_ATTN`` contract (``--diffusion-attention-config``), so one JSON string
configures both::

    {"default": {"backend": "TRTLLM_ATTN",
                 "skip_softmax": {"target_sparsity": 0.65, "disabled_until_timestep": 0.86}},
     "per_role": {"cross": {"backend": "TORCH_SDPA"}}}

Specs are immutable and validated on construction; every error names the field, the value and what is valid.
Nothing here looks at the GPU: whether a backend can run is decided when a plan is made (``plan.py``).

This package's extensions beyond vLLM-Omni's schema (its own parser refuses them as unknown keys): a spec's
``accuracy`` (:class:`AccuracySpec`: the accuracy probe and its guard), its ``dense_kernel`` (Hopper's dense
kernel under ``TRTLLM_ATTN``) and the SAGE step schedule ``quant.disabled_until_timestep`` /
``quant.disabled_below_timestep`` (:class:`AttnQuantSpec`), and Skip-Softmax reuse ``skip_softmax.reuse_steps`` /
``reuse_test`` (:class:`SkipSoftmaxSpec`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from types import MappingProxyType
from typing import Mapping, Sequence

from .errors import AttentionConfigError, invalid, warn_user

AUTO = "auto"
TRTLLM_ATTN = "TRTLLM_ATTN"
TORCH_REFERENCE = "TORCH_REFERENCE"
TORCH_SDPA = "TORCH_SDPA"
BACKEND_NAMES = (AUTO, TRTLLM_ATTN, TORCH_REFERENCE, TORCH_SDPA)
# Spellings used by the vLLM-Omni design notes and CLI; all map to the canonical names above.
BACKEND_ALIASES = {"TRTLLM-GEN": TRTLLM_ATTN, "TRTLLM_GEN": TRTLLM_ATTN, "TRTLLM": TRTLLM_ATTN, "SDPA": TORCH_SDPA,
                   "REFERENCE": TORCH_REFERENCE}
# Backends that implement Skip-Softmax and SAGE; TORCH_SDPA is a dense baseline only.
FEATURE_BACKENDS = (AUTO, TRTLLM_ATTN, TORCH_REFERENCE)

# The dense kernels TRTLLM_ATTN runs on Hopper (sm_90) at steps without SAGE or Skip-Softmax: FlashInfer's FMHAv2,
# FlashAttention-4 (pip flash-attn-4), cuDNN through torch SDPA; "auto" takes the fastest that runs.
FMHA_V2_DENSE, FLASH_ATTN4, CUDNN = "fmha_v2", "flash_attn4", "cudnn"
DENSE_KERNELS = (AUTO, FMHA_V2_DENSE, FLASH_ATTN4, CUDNN)

QK_DTYPES = ("int8", "fp8_e4m3")
SAGE_BLOCK_SIZES = (1, 4, 16)  # Q/K blocks of the Triton kernel and trtllm-gen (K)
SAGE_Q_BLOCK_SIZES = SAGE_BLOCK_SIZES + (64,)  # 64: Hopper FMHAv2 SAGE
SAGE_K_BLOCK_SIZES = SAGE_BLOCK_SIZES + (64, 128)
PROBE_ROWS_MAX = 1024  # the accuracy probe's query rows per call: its exact attention costs rows × keys × heads
# The pipeline components that hold transformers (Wan 2.2 A14B has both): the attributes an install looks at, the
# checkpoint folders a calibration is read from, the component keys of ``per_role``.
TRANSFORMER_COMPONENTS = ("transformer", "transformer_2")
# One attention call site: (component, layer, role, category), e.g.
# ("transformer_2", "blocks.3.attn1", "self_attn", "self").
Site = tuple[str, str, str, str]


def is_finite_number(value) -> bool:
    """Whether ``value`` is a Python int or float (a bool is not a number here) with a finite value."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def finite_number(field_name: str, value, low: float | None = None, high: float | None = None, *,
                  above: float | None = None, valid: str | None = None) -> float:
    """``value`` as a float when it is a finite number with ``low <= value <= high`` and ``value > above`` (a bound
    left ``None`` does not apply); else :class:`AttentionConfigError` naming ``field_name``, the value and what is
    valid (``valid``, or the range in words). The one validator of numbers in configs and checkpoints."""
    if (is_finite_number(value) and (low is None or value >= low) and (high is None or value <= high)
            and (above is None or value > above)):
        return float(value)
    raise invalid(field_name, value, valid or _range_text(low, high, above))


def _range_text(low, high, above) -> str:
    if low is not None and high is not None:
        return f"a finite number in [{low:g}, {high:g}]"
    bounds = [f"{sign} {bound:g}" for sign, bound in ((">=", low), ("<=", high), (">", above)) if bound is not None]
    return "a finite number " + " and ".join(bounds) if bounds else "a finite number"


def positive_int(field_name: str, value, high: int | None = None) -> int:
    """``value`` when it is an int (not a bool) with ``1 <= value <= high``; else :class:`AttentionConfigError`
    naming ``field_name``, the value and what is valid."""
    if type(value) is int and value >= 1 and (high is None or value <= high):
        return value
    raise invalid(field_name, value, f"an int in [1, {high}]" if high is not None else "an int >= 1")


def _reject_unknown_keys(where: str, data: Mapping, allowed) -> None:
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise AttentionConfigError(f"{where}: unknown key(s) {unknown}; valid keys are {sorted(allowed)}")


@dataclass(frozen=True)
class SkipSoftmaxSpec:
    """Skip-Softmax (BLASST) sparsity.

    Exactly one of ``target_sparsity`` (a point on a calibrated curve, factor = a·exp(b·s)) and ``threshold``
    (λ itself: a KV tile is skipped when every row's ``exp(tile_max - running_max) < λ``) is set, or neither
    (then only the gate is configured and nothing is skipped). The kernels take one threshold scale factor per call
    and divide it by each sequence's key length, so an explicit ``threshold`` λ becomes the factor λ·max_kv_len and
    on a ragged batch (HunyuanVideo 1.5's per-sample text lengths) sequence i skips with λ·max_kv_len / kv_len_i:
    the longest gets λ, shorter ones a larger λ. The reference backend does exactly the same.

    Skipping is off while the normalized timestep t = timestep / num_train_timesteps is above
    ``disabled_until_timestep`` (0 = never off).

    ``reuse_steps`` (this package's extension; 0 = off): a step that tests every tile keeps, per call site and
    pass (a classifier-free-guidance pass has its own), the map of the tiles it skipped; the next
    ``reuse_steps`` steps of the same pipeline call skip those tiles without loading or multiplying them, test the
    others and add what they skip. Then, or when the timestep gate, the SAGE schedule or the accuracy guard
    changes what the site runs, every tile is tested again. Maps belong to the pipeline call and are freed when
    it ends. ``reuse_test`` False: the reusing steps test nothing (they skip the map's tiles and compute all the
    others, and the map stays as the step that made it left it): no test's cost on those steps, and the sparsity
    of the curve without reuse.
    """

    target_sparsity: float | None = None
    threshold: float | None = None
    disabled_until_timestep: float = 0.0
    reuse_steps: int = 0
    reuse_test: bool = True

    def __post_init__(self):
        if self.target_sparsity is not None:
            object.__setattr__(self, "target_sparsity",
                               finite_number("skip_softmax.target_sparsity", self.target_sparsity, 0.0, 1.0))
        if self.threshold is not None:
            object.__setattr__(self, "threshold", finite_number("skip_softmax.threshold", self.threshold, 0.0))
            if self.threshold >= 1.0:
                warn_user(f"skip_softmax.threshold={self.threshold:g} >= 1 skips nearly every KV tile; "
                          "typical values are 0.01-0.9")
        if self.target_sparsity is not None and self.threshold is not None:
            raise AttentionConfigError(
                f"skip_softmax.target_sparsity={self.target_sparsity!r} and skip_softmax.threshold="
                f"{self.threshold!r} are mutually exclusive: set one of them")
        object.__setattr__(self, "disabled_until_timestep", finite_number(
            "skip_softmax.disabled_until_timestep", self.disabled_until_timestep, 0.0, 1.0))
        if type(self.reuse_steps) is not int or self.reuse_steps < 0:
            raise invalid("skip_softmax.reuse_steps", self.reuse_steps, "an int >= 0 (0: every step tests every tile)")
        if self.reuse_steps and not self.skips:
            raise invalid("skip_softmax.reuse_steps", self.reuse_steps,
                          "0 unless skip_softmax.target_sparsity or threshold is set (it reuses what they skip)")
        if type(self.reuse_test) is not bool:
            raise invalid("skip_softmax.reuse_test", self.reuse_test,
                          "true (reusing steps test the tiles their map does not hold) or false (they test nothing)")

    @property
    def skips(self) -> bool:
        """Whether any tile can be skipped (a target or threshold is set)."""
        return self.target_sparsity is not None or self.threshold is not None

    @classmethod
    def from_dict(cls, data: Mapping) -> "SkipSoftmaxSpec":
        _reject_unknown_keys("skip_softmax", data, [f.name for f in dataclasses.fields(cls)])
        return cls(**data)


@dataclass(frozen=True)
class AttnQuantSpec:
    """SAGE quantization: Q/K per block of ``q_block_size`` / ``k_block_size`` tokens to ``dtype_qk``, K smoothed,
    V per channel to fp8_e4m3. ``dtype_qk=None`` means no quantization (dense).

    SAGE step schedule (this package's extension; vLLM-Omni's schema has no such keys): SAGE is held off (the call
    runs dense at full precision) while the normalized timestep t = timestep / num_train_timesteps is above
    ``disabled_until_timestep`` (the first steps of a call) or below ``disabled_below_timestep`` (the last ones);
    0 turns either end off. Same terms as ``skip_softmax.disabled_until_timestep``. The kernel fields above are
    what the attention op receives; the schedule is planned once per step outside it.

    Block sizes left ``None`` take the fastest kernel of the GPU (Hopper fp8 self-attention: FMHAv2 with Q blocks
    of 64 and one K scale per sequence and head; elsewhere Q 1 / K 16). Explicit sizes are checked here against every size some kernel has
    (:data:`SAGE_Q_BLOCK_SIZES`, :data:`SAGE_K_BLOCK_SIZES`) and, when attention is planned, against the kernels
    of the GPU it runs on (1, 4, 16 on the Triton kernel and trtllm-gen's K; Q 1 on trtllm-gen; Q 64 with K 64 or
    128 on Hopper's FMHAv2, fp8 only).
    """

    dtype_qk: str | None = None
    q_block_size: int | None = None
    k_block_size: int | None = None
    disabled_until_timestep: float = 0.0
    disabled_below_timestep: float = 0.0

    def __post_init__(self):
        if self.dtype_qk is not None and self.dtype_qk not in QK_DTYPES:
            raise invalid("quant.dtype_qk", self.dtype_qk, f"one of {list(QK_DTYPES)} or null")
        for name in ("disabled_until_timestep", "disabled_below_timestep"):
            value = finite_number(f"quant.{name}", getattr(self, name), 0.0, 1.0)
            if value and self.dtype_qk is None:
                raise invalid(f"quant.{name}", value, "0 unless quant.dtype_qk is set (it schedules SAGE)")
            object.__setattr__(self, name, value)
        until, below = self.disabled_until_timestep, self.disabled_below_timestep
        if until and below >= until:
            raise invalid("quant.disabled_below_timestep", below, f"a value below quant.disabled_until_timestep="
                          f"{until:g} (SAGE runs where disabled_below_timestep <= t <= disabled_until_timestep)")
        for name, valid in (("q_block_size", SAGE_Q_BLOCK_SIZES), ("k_block_size", SAGE_K_BLOCK_SIZES)):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value not in valid):
                fmha_v2 = ", ".join(str(b) for b in valid if b not in SAGE_BLOCK_SIZES)
                raise invalid(f"quant.{name}", value, f"an int: one of {list(SAGE_BLOCK_SIZES)} (Triton, trtllm-gen) or "
                              f"{fmha_v2} (Hopper FMHAv2, fp8); or null for the GPU's fastest kernel")

    @property
    def enabled(self) -> bool:
        return self.dtype_qk is not None

    @property
    def scheduled(self) -> bool:
        """Whether a step schedule holds SAGE off at some timesteps."""
        return bool(self.disabled_until_timestep or self.disabled_below_timestep)

    def runs_at(self, timestep: float | None) -> bool:
        """Whether SAGE runs at normalized ``timestep`` (None: unknown, so a scheduled SAGE is held off)."""
        if not self.scheduled:
            return True
        if timestep is None:
            return False
        return not (self.disabled_until_timestep and timestep > self.disabled_until_timestep) and \
            timestep >= self.disabled_below_timestep

    @classmethod
    def from_dict(cls, data: Mapping) -> "AttnQuantSpec":
        _reject_unknown_keys("quant", data, [f.name for f in dataclasses.fields(cls)])
        return cls(**data)


@dataclass(frozen=True)
class AccuracySpec:
    """The accuracy probe and its guard (this package's extension; vLLM-Omni's schema has no such key).

    Probe: at probed steps (steps 0, ``probe_every``, 2·``probe_every``... of each pipeline call) every call of the
    layer also computes exact attention (float64, dense, every key) for ``probe_rows`` of its query rows, spread
    evenly over its tokens, all heads, and adds the squared error of what ran and the squared exact output to the
    layer's counters on the device. ``handle.stats`` reports the relative error ``sqrt(Σ error² / Σ exact²)`` per
    layer and step next to sparsity. Other steps cost nothing but reading the row count (0) in the op.

    Guard, when ``max_error`` is set: at the end of a probed step, a layer whose relative error exceeds it stops
    running SAGE for the rest of the pipeline call, or, when it ran without SAGE, stops skipping; a warning names the
    layer, the error and the bound. A dense layer above the bound is reported the same way (nothing to drop).
    """

    probe_rows: int = 16
    probe_every: int = 1
    max_error: float | None = None

    def __post_init__(self):
        positive_int("accuracy.probe_rows", self.probe_rows, PROBE_ROWS_MAX)
        positive_int("accuracy.probe_every", self.probe_every)
        if self.max_error is not None:
            object.__setattr__(self, "max_error", finite_number("accuracy.max_error", self.max_error, above=0.0))

    def probes(self, step: int) -> bool:
        """Whether step ``step`` (0-based, of a pipeline call) is probed."""
        return step % self.probe_every == 0

    @classmethod
    def from_dict(cls, data: Mapping) -> "AccuracySpec":
        if not isinstance(data, Mapping):
            raise invalid("accuracy", data, "a mapping with keys probe_rows, probe_every, max_error")
        _reject_unknown_keys("accuracy", data, [f.name for f in dataclasses.fields(cls)])
        return cls(**data)


@dataclass(frozen=True)
class AttentionSpec:
    """One attention setting: a backend, optionally with Skip-Softmax and/or SAGE quantization, and the accuracy
    probe (``accuracy``, this package's extension).

    ``dense_kernel`` (this package's extension): which kernel ``TRTLLM_ATTN`` runs on Hopper at steps without SAGE
    or Skip-Softmax (:data:`DENSE_KERNELS`; ``auto``: FlashAttention-4 where installed, else cuDNN). A kernel
    other than ``auto`` pins it (for A/B measurements) and needs ``backend`` TRTLLM_ATTN; one that cannot run on
    the GPU raises at install."""

    backend: str = AUTO
    skip_softmax: SkipSoftmaxSpec | None = None
    quant: AttnQuantSpec | None = None
    accuracy: AccuracySpec | None = None
    dense_kernel: str = AUTO

    def __post_init__(self):
        object.__setattr__(self, "backend", canonical_backend(self.backend))
        if isinstance(self.skip_softmax, Mapping):
            object.__setattr__(self, "skip_softmax", SkipSoftmaxSpec.from_dict(self.skip_softmax))
        if isinstance(self.quant, Mapping):
            object.__setattr__(self, "quant", AttnQuantSpec.from_dict(self.quant))
        if self.accuracy is not None and not isinstance(self.accuracy, AccuracySpec):
            object.__setattr__(self, "accuracy", AccuracySpec.from_dict(self.accuracy))
        if self.skip_softmax is not None and not isinstance(self.skip_softmax, SkipSoftmaxSpec):
            raise invalid("skip_softmax", self.skip_softmax, "a SkipSoftmaxSpec, a dict or null")
        if self.quant is not None and not isinstance(self.quant, AttnQuantSpec):
            raise invalid("quant", self.quant, "an AttnQuantSpec, a dict or null")
        if self.quant is not None and not self.quant.enabled:
            object.__setattr__(self, "quant", None)
        if self.dense_kernel not in DENSE_KERNELS:
            raise invalid("dense_kernel", self.dense_kernel, f"one of {list(DENSE_KERNELS)} (Hopper's dense kernel "
                          "under TRTLLM_ATTN; 'auto' takes the fastest that runs)")
        if self.dense_kernel != AUTO and self.backend != TRTLLM_ATTN:
            raise invalid("dense_kernel", self.dense_kernel, f"'auto' with backend={self.backend!r}: it chooses "
                          f"{TRTLLM_ATTN}'s dense kernel on Hopper, so set backend {TRTLLM_ATTN!r} to pin one")
        if self.backend not in FEATURE_BACKENDS:
            for name, value in (("skip_softmax", self.skip_softmax), ("quant", self.quant)):
                if value is not None:
                    raise AttentionConfigError(
                        f"{name} is set but backend={self.backend!r} runs dense attention only; "
                        f"{name} needs one of {list(FEATURE_BACKENDS)}")

    @property
    def skips(self) -> bool:
        return self.skip_softmax is not None and self.skip_softmax.skips

    @classmethod
    def from_dict(cls, data: Mapping) -> "AttentionSpec":
        if not isinstance(data, Mapping):
            raise invalid("spec", data, "a mapping with keys backend, skip_softmax, quant, accuracy, dense_kernel")
        _reject_unknown_keys("spec", data, ["backend", "skip_softmax", "quant", "accuracy", "dense_kernel"])
        return cls(**data)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SWITCH_ON, SWITCH_OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def env_switch(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the environment variable ``name`` turns its switch on (unset: off). Every switch of the package is
    read here: ``1 / true / yes / on`` and ``0 / false / no / off`` (any case, or empty); another value is refused
    naming the variable."""
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None:
        return False
    value = raw.strip().lower()
    if value in SWITCH_ON:
        return True
    if value in SWITCH_OFF:
        return False
    raise invalid(name, raw, f"one of {list(SWITCH_ON + SWITCH_OFF[:-1])} (or empty)")


def canonical_backend(name) -> str:
    """Map a user spelling of a backend name to its canonical name, or raise naming the valid ones."""
    if not isinstance(name, str):
        raise invalid("backend", name, f"one of {list(BACKEND_NAMES)}")
    upper = name.strip().upper()
    if upper == "AUTO":
        return AUTO
    upper = BACKEND_ALIASES.get(upper, upper)
    if upper not in BACKEND_NAMES:
        raise invalid("backend", name, f"one of {list(BACKEND_NAMES)} (aliases: {sorted(BACKEND_ALIASES)})")
    return upper


@dataclass(frozen=True)
class AttentionConfig:
    """Attention settings for one pipeline: a ``default`` spec and optional ``per_role`` overrides.

    ``per_role`` keys, from most to least specific (a matching key's spec replaces the whole spec):

    1. the exact layer name, ``<component>.<layer>`` then ``<layer>`` (``"transformer_2.blocks.3.attn1"``);
    2. a layer-name glob, matched with fnmatch against ``<component>.<layer>`` and ``<layer>``
       (``"blocks.0.*"``, ``"transformer_2.blocks.3[0-9].attn1"``). Among globs that match a layer, the one whose
       layers (over the whole model) are a strict subset of every other's wins; two that match a layer with
       neither more specific raise at install time, naming both;
    3. ``<component>.<role>`` then ``<component>.<category>`` (``"transformer_2.cross"``);
    4. the exact role (``"self_attn"``, ``"cross_attn"``; each processor documents its roles);
    5. the role category: ``self``, ``cross`` or ``joint``;
    6. the component (``"transformer"``, ``"transformer_2"``);
    7. ``default``.

    A key must name a component, role, category or layer the model has (:meth:`check_keys`).
    """

    default: AttentionSpec = field(default_factory=AttentionSpec)
    per_role: Mapping[str, AttentionSpec] = field(default_factory=dict)

    def __post_init__(self):
        default = self.default
        if isinstance(default, Mapping):
            default = AttentionSpec.from_dict(default)
        if not isinstance(default, AttentionSpec):
            raise invalid("default", default, "an AttentionSpec or a dict")
        object.__setattr__(self, "default", default)
        if not isinstance(self.per_role, Mapping):
            raise invalid("per_role", self.per_role, "a mapping of role -> spec")
        roles = {}
        for key, spec in self.per_role.items():
            if not isinstance(key, str) or not key:
                raise invalid("per_role key", key, "a non-empty string (role, category, component or layer glob)")
            try:
                roles[key] = spec if isinstance(spec, AttentionSpec) else AttentionSpec.from_dict(spec)
            except AttentionConfigError as e:
                raise AttentionConfigError(f"per_role[{key!r}]: {e}") from None
        object.__setattr__(self, "per_role", MappingProxyType(roles))

    def __reduce__(self):
        # per_role is a read-only view (MappingProxyType), which neither pickles nor deep-copies
        return type(self), (self.default, dict(self.per_role))

    @classmethod
    def from_dict(cls, data: Mapping) -> "AttentionConfig":
        """Parse the ``--diffusion-attention-config`` shape: ``{"default": {...}, "per_role": {...}}``."""
        if not isinstance(data, Mapping):
            raise invalid("attention config", data, 'a JSON object like {"default": {"backend": "TRTLLM_ATTN"}}')
        _reject_unknown_keys("attention config", data, ["default", "per_role"])
        return cls(default=data.get("default", {}), per_role=data.get("per_role", {}))

    @classmethod
    def from_json(cls, text: str) -> "AttentionConfig":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise AttentionConfigError(f"attention config is not valid JSON ({e}): {text!r}") from None
        return cls.from_dict(data)

    @classmethod
    def coerce(cls, value: "AttentionConfig | AttentionSpec | Mapping | str | None") -> "AttentionConfig":
        """Accept a config, a single spec (used as default), a dict, a JSON string or None (auto, dense)."""
        if value is None:
            return cls()
        if isinstance(value, AttentionConfig):
            return value
        if isinstance(value, AttentionSpec):
            return cls(default=value)
        if isinstance(value, str):
            return cls.from_json(value)
        return cls.from_dict(value)

    def to_dict(self) -> dict:
        return {"default": self.default.to_dict(), "per_role": {k: v.to_dict() for k, v in self.per_role.items()}}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def with_accuracy(self, accuracy: AccuracySpec | Mapping | None) -> "AttentionConfig":
        """This config with ``accuracy`` (the probe, and the guard when it has ``max_error``) on the default and on
        every per_role spec."""
        def probed(spec: AttentionSpec) -> AttentionSpec:
            return dataclasses.replace(spec, accuracy=accuracy)

        return AttentionConfig(default=probed(self.default), per_role={k: probed(v) for k, v in self.per_role.items()})

    def resolve(self, component: str, layer: str, role: str, category: str, *,
                sites: Sequence[Site] | None = None) -> tuple[str, AttentionSpec]:
        """Return ``(matched key, spec)`` for one attention call site; see the class docstring for the order.

        Layer globs are ranked by the layers they match among ``sites`` (all call sites of the model; see
        :meth:`resolve_sites`). Without ``sites`` only this site is known, so two globs that both match it are
        tied and raise: pass the model's sites, or resolve them all at install time with :meth:`resolve_sites`.
        """
        site = (component, layer, role, category)
        known = list(sites) if sites is not None else []
        if site not in known:
            known.append(site)
        return self._resolve_one(site, self._glob_layers(known))

    def resolve_sites(self, sites: Sequence[Site]) -> dict[Site, tuple[str, AttentionSpec]]:
        """Resolve every call site ``(component, layer, role, category)`` of a model at once (at install time).

        Checks the keys first (:meth:`check_keys`), then gives each site its ``(matched key, spec)``. A layer glob
        outranks another when the layers it matches are a strict subset of the other's; two globs of equal rank
        that both match a layer raise :class:`AttentionConfigError` naming both.
        """
        sites = list(dict.fromkeys(sites))
        self.check_keys(sites)
        glob_layers = self._glob_layers(sites)
        return {site: self._resolve_one(site, glob_layers) for site in sites}

    def _glob_layers(self, sites: Sequence[Site]) -> dict[str, frozenset[tuple[str, str]]]:
        """Per glob key, the ``(component, layer)`` pairs among ``sites`` it matches."""
        return {key: frozenset((c, layer) for c, layer, _, _ in sites if _glob_matches(key, c, layer))
                for key in self.per_role if _is_glob_key(key)}

    def _resolve_one(self, site: Site, glob_layers: Mapping[str, frozenset]) -> tuple[str, AttentionSpec]:
        component, layer, role, category = site
        for key in (f"{component}.{layer}", layer):
            if key in self.per_role:
                return key, self.per_role[key]
        matching = {key: layers for key, layers in glob_layers.items() if (component, layer) in layers}
        # the most specific globs: those no other matching glob is a strict subset of
        best = [key for key, layers in matching.items() if not any(other < layers for other in matching.values())]
        if len(best) > 1:
            raise AttentionConfigError(
                f"per_role keys {best[0]!r} and {best[1]!r} both match {component}.{layer} and neither matches a "
                "strict subset of the other's layers, so neither is more specific; add an exact key for the layer "
                "or narrow one glob")
        if best:
            return best[0], self.per_role[best[0]]
        for key in (f"{component}.{role}", f"{component}.{category}", role, category, component):
            if key in self.per_role:
                return key, self.per_role[key]
        return "default", self.default

    def check_keys(self, sites: Sequence[Site]) -> None:
        """Raise for a ``per_role`` key that names no call site among ``(component, layer, role, category)``:
        components, roles, categories and layers the model does not have are refused, naming what it has."""
        components = sorted({c for c, _, _, _ in sites})
        roles = sorted({r for _, _, r, _ in sites})
        categories = sorted({cat for _, _, _, cat in sites})
        names = set(components) | set(roles) | set(categories)
        for component, layer, role, category in sites:
            names.update({f"{component}.{role}", f"{component}.{category}", layer, f"{component}.{layer}"})
        for key in self.per_role:
            if key in names or (_is_glob_key(key) and any(_glob_matches(key, c, layer) for c, layer, _, _ in sites)):
                continue
            example = f"{sites[0][0]}.{sites[0][1]}" if sites else "transformer.blocks.0.attn1"
            raise AttentionConfigError(
                f"per_role key {key!r} matches no attention layer of this pipeline; valid keys: components "
                f"{components}, roles {roles}, categories {categories}, '<component>.<role>' or "
                f"'<component>.<category>', a layer name such as {example!r}, or a glob over layer names")


def _glob_matches(key: str, component: str, layer: str) -> bool:
    return fnmatchcase(f"{component}.{layer}", key) or fnmatchcase(layer, key)


def _is_glob_key(key: str) -> bool:
    return any(ch in key for ch in "*?[")
