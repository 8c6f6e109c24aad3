"""The test plan's attention configurations (:func:`test_plan_configs`), a SageAttention peer
(:func:`sageattention_peer`) and a no-attention step (:func:`no_attention`), patched in through a temporarily
replaced ``TORCH_SDPA`` backend (:func:`replaced_backend`).

``sageattention`` is imported inside the functions that need it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Sequence

import torch

from diffusers_trtllm.backends.base import KernelPlan, KernelResult, VarlenQKV, get_backend, register_backend
from diffusers_trtllm.cli import SAGE_PRESET
from diffusers_trtllm.config import TORCH_SDPA, TRTLLM_ATTN, AttentionConfig, AttnQuantSpec


REFERENCE_LABEL = "TORCH_SDPA dense (ref)"
SAGE_ATTN_LABEL = "SAGE_ATTN (SageAttention)"
PLAN_GATES = (1.00, 0.97, 0.94)

# Which test-plan table a configuration belongs to.
TABLE_SAGE, TABLE_SKIP, TABLE_SAGE_SKIP, TABLE_BACKENDS = "sage", "skip", "sage+skip", "backends"


@dataclass(frozen=True)
class EvalConfig:
    """One configuration of the test plan. ``peer`` names an attention implementation outside this package
    (``SAGE_ATTN``), patched in for the run; ``config`` is then TORCH_SDPA everywhere."""

    label: str
    table: str
    config: AttentionConfig
    gate: float | None = None
    peer: str | None = None

    @property
    def warmup(self) -> AttentionConfig:
        """The configuration to warm up with: see :func:`open_gate`."""
        return open_gate(self.config)


def open_gate(config: AttentionConfig) -> AttentionConfig:
    """``config`` with every Skip-Softmax gate open (D = 1: no step is kept dense), so a short warm-up runs every
    kernel the configuration will use (first-call costs, kernel builds) before the timed run."""
    def opened(spec):
        if spec.skip_softmax is None:
            return spec
        return dataclasses.replace(spec, skip_softmax=dataclasses.replace(spec.skip_softmax,
                                                                          disabled_until_timestep=1.0))

    return AttentionConfig(default=opened(config.default),
                           per_role={key: opened(spec) for key, spec in config.per_role.items()})


def skip_settings(threshold: float | None, target_sparsity: float | None) -> dict:
    """The Skip-Softmax amount: λ itself, or a point on a calibrated curve (needs a calibrated checkpoint)."""
    if (threshold is None) == (target_sparsity is None):
        raise ValueError("set exactly one of threshold (λ) and target_sparsity")
    return {"threshold": threshold} if threshold is not None else {"target_sparsity": target_sparsity}


def attention_config(backend: str, *, sdpa_roles: Sequence[str] = (), skip: Mapping | None = None,
                     quant: AttnQuantSpec | None = None) -> AttentionConfig:
    """``backend`` (with ``skip`` / ``quant``) for every attention call except ``sdpa_roles``, which run dense on
    TORCH_SDPA."""
    default = {"backend": backend, "skip_softmax": dict(skip) if skip else None,
               "quant": dataclasses.asdict(quant) if quant else None}
    return AttentionConfig.from_dict({"default": default,
                                      "per_role": {role: {"backend": TORCH_SDPA} for role in sdpa_roles}})


def backend_label(backend: str) -> str:
    """How the tables name the backend of the TRT-LLM configurations (the test plan says ``trtllm-gen``)."""
    return "trtllm-gen" if backend == TRTLLM_ATTN else backend


def test_plan_configs(backend: str, skip: Mapping, *, gates: Sequence[float] = PLAN_GATES,
                      sage: AttnQuantSpec = SAGE_PRESET, sdpa_roles: Sequence[str] = (),
                      dtype_name: str = "BF16") -> list[EvalConfig]:
    """The test plan's configurations in run order; the first is the reference. ``backend`` runs every
    non-reference configuration (TRTLLM_ATTN on a GPU; TORCH_REFERENCE, same semantics, on a CPU) and names them,
    with ``dtype_name`` (the pipeline's dtype) on the dense one."""
    sage_name = {"fp8_e4m3": "FP8", "int8": "INT8"}[sage.dtype_qk] + "-SAGE"
    name = backend_label(backend)

    def make(**kw) -> AttentionConfig:
        return attention_config(backend, sdpa_roles=sdpa_roles, **kw)

    sdpa_only = AttentionConfig.from_dict({"default": {"backend": TORCH_SDPA}})
    configs = [EvalConfig(REFERENCE_LABEL, TABLE_BACKENDS, sdpa_only),
               EvalConfig(f"{name} {dtype_name} dense", TABLE_SAGE, make()),
               EvalConfig(f"{name} {sage_name}", TABLE_SAGE, make(quant=sage))]
    for gate in gates:
        configs.append(EvalConfig(f"{name} Skip D={gate:.2f}", TABLE_SKIP,
                                  make(skip={**skip, "disabled_until_timestep": gate}), gate))
    for gate in gates:
        configs.append(EvalConfig(f"{name} {sage_name}+Skip D={gate:.2f}", TABLE_SAGE_SKIP,
                                  make(skip={**skip, "disabled_until_timestep": gate}, quant=sage), gate))
    configs.append(EvalConfig(SAGE_ATTN_LABEL, TABLE_BACKENDS, sdpa_only, peer="SAGE_ATTN"))
    return configs


def describe_config(config: AttentionConfig) -> str:
    """``config`` as compact JSON: unset (null) fields left out."""
    def drop_unset(value):
        if isinstance(value, dict):
            return {k: drop_unset(v) for k, v in value.items() if v is not None and v != {}}
        return value

    return json.dumps(drop_unset(json.loads(config.to_json())), ensure_ascii=False)


@contextlib.contextmanager
def replaced_backend(name: str, runner: Callable[[VarlenQKV, KernelPlan], KernelResult],
                     check: Callable[[KernelPlan, VarlenQKV], str | None] = lambda plan, qkv: None) -> Iterator[None]:
    """Temporarily run backend ``name``'s calls through ``runner`` (a peer implementation, or none at all)."""
    original = get_backend(name)
    register_backend(name, runner, check, original.priority)
    try:
        yield
    finally:
        register_backend(original.name, original.runner, original.check, original.priority)


def sageattention_unavailable_reason(device: str | torch.device) -> str | None:
    """Why the SageAttention peer cannot run here, or None."""
    try:
        import sageattention  # noqa: F401
    except Exception as e:  # noqa: BLE001  (a broken install raises more than ImportError)
        return f"sageattention is not importable ({type(e).__name__}: {e}); pip install sageattention on a CUDA GPU"
    if torch.device(device).type != "cuda":
        return f"SageAttention runs on CUDA GPUs only; this run is on {device}"
    return None


def _sageattention_run(qkv: VarlenQKV, plan: KernelPlan) -> KernelResult:
    from sageattention import sageattn

    def one(q, k, v):  # [B, S, H, D]; SageAttention 1 takes equal head counts
        if k.shape[2] != q.shape[2]:
            k, v = (x.repeat_interleave(q.shape[2] // x.shape[2], dim=2) for x in (k, v))
        return sageattn(q, k, v, tensor_layout="NHD", is_causal=plan.causal, sm_scale=plan.scale)

    if qkv.uniform:
        b = qkv.batch_size
        out = one(*(x.view(b, -1, *x.shape[1:]) for x in (qkv.q, qkv.k, qkv.v)))
        return KernelResult(out.reshape(qkv.q.shape))
    out = torch.empty_like(qkv.q)
    for q, k, v, rows in qkv.sequences():
        out[rows] = one(q[None], k[None], v[None])[0]
    return KernelResult(out)


def sageattention_peer() -> contextlib.AbstractContextManager:
    """Run TORCH_SDPA's calls through SageAttention (PyPI ``sageattention``) while the context is open."""
    return replaced_backend(TORCH_SDPA, _sageattention_run)


def no_attention() -> contextlib.AbstractContextManager:
    """TORCH_SDPA's calls return Q unchanged: a step without attention work, to measure attention's share."""
    return replaced_backend(TORCH_SDPA, lambda qkv, plan: KernelResult(qkv.q))
