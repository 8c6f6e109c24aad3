"""``TrtllmAttnProcessor``: the base of every model's processor.

A subclass does the model's projections, normalisation and rotary embedding exactly as diffusers' default
processor does, and hands Q/K/V to :meth:`TrtllmAttnProcessor.attend` (``[B, S, H, D]``) or
:meth:`TrtllmAttnProcessor.attend_varlen` (packed sequences) with the role of that attention. The base resolves
the spec for the layer, role and current timestep into a plan, runs it, and records what ran.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..backends import run_backend
from ..backends.base import VarlenQKV
from ..config import AttentionConfig
from ..plan import AttentionPlan, CallSite, plan_attention
from ..session import AttentionSession, TimestepReader, read_timestep_kwarg


class TrtllmAttnProcessor:
    """Base attention processor.

    Args:
        config: an :class:`~diffusers_trtllm.AttentionConfig` (or spec, dict, JSON string); ignored when
            ``session`` is given. A processor built from a config owns a fresh session, which knows no timestep:
            use :func:`~diffusers_trtllm.enable_trtllm_attention` when a timestep gate is configured.
        session: the pipeline's :class:`~diffusers_trtllm.session.AttentionSession` (shared by its processors).
        component: the pipeline component this processor serves (``"transformer"``, ``"transformer_2"``).
        layer: the attention module's name in the transformer; when ``None`` it is looked up in the session.
    """

    #: role -> category (``self``, ``cross`` or ``joint``); the keys are the role names configs can target.
    ROLES: ClassVar[dict[str, str]] = {}
    #: class names of the attention modules this processor serves.
    ATTENTION_CLASSES: ClassVar[tuple[str, ...]] = ()
    #: class names of the transformers it is made for.
    TRANSFORMER_CLASSES: ClassVar[tuple[str, ...]] = ()
    #: how the transformer's forward arguments give the raw scheduler timestep.
    read_timestep: ClassVar[TimestepReader] = staticmethod(read_timestep_kwarg("timestep"))

    # diffusers sets these on processors; they are read by its dispatcher, which this processor does not use.
    _attention_backend = None
    _parallel_config = None

    def __init__(self, config: AttentionConfig | dict | str | None = None, *,
                 session: AttentionSession | None = None, component: str = "transformer", layer: str | None = None):
        self.session = session if session is not None else AttentionSession(config)
        self.component = component
        self.layer = layer
        self.last_plan: AttentionPlan | None = None

    @classmethod
    def serves(cls, module: torch.nn.Module) -> bool:
        """Whether this processor takes over ``module``'s attention; ``enable_trtllm_attention`` leaves the
        processors of other modules as they are. Subclasses narrow it when one attention class serves several
        purposes (HunyuanVideo 1.5's text refiner and its joint blocks both use diffusers' ``Attention``)."""
        return type(module).__name__ in cls.ATTENTION_CLASSES

    def check_module(self, attn: torch.nn.Module) -> None:
        """Raise ``TypeError`` when ``attn`` is not an attention module of the model this processor is made for
        (``transformer.set_attn_processor`` accepts any processor; a wrong one would fail deep in the model code)."""
        name = type(attn).__name__
        if name in self.ATTENTION_CLASSES:
            return
        right = [cls.__name__ for cls in TrtllmAttnProcessor.__subclasses__() if name in cls.ATTENTION_CLASSES]
        hint = f"; its processor is {right[0]}" if right else "; this package has no processor for it"
        raise TypeError(f"{type(self).__name__} is made for {', '.join(self.TRANSFORMER_CLASSES)} "
                        f"({', '.join(self.ATTENTION_CLASSES)} modules) but was called on a {name}{hint} "
                        "(or use enable_trtllm_attention, which picks the processor from the model)")

    def call_site(self, attn: torch.nn.Module, role: str) -> CallSite:
        if self.layer is not None:
            component, layer = self.component, self.layer
        else:
            component, layer = self.session.layer_of(attn, self.component)
        return CallSite(component, layer, role, self.ROLES[role])

    def attend_varlen(self, attn: torch.nn.Module, qkv: VarlenQKV, role: str, *, causal: bool = False,
                      sparse_ok: bool = True, quant_ok: bool = True, scale: float | None = None) -> torch.Tensor:
        """Run one attention call on packed sequences; returns ``[total_q, heads_q, head_dim]`` in q's dtype."""
        if self._parallel_config is not None:
            raise NotImplementedError(
                f"{type(self).__name__} does not implement context parallelism (Ulysses/ring); install it on a "
                "transformer without enable_parallelism(...)")
        site = self.call_site(attn, role)
        plan = plan_attention(self.session, site, qkv, scale=qkv.head_dim ** -0.5 if scale is None else scale,
                              causal=causal, sparse_ok=sparse_ok, quant_ok=quant_ok)
        result = run_backend(plan.backend, qkv, plan.kernel)
        self.last_plan = plan
        if self.session.collect_stats:
            skipped = result.skipped_tiles if plan.kernel.skips else 0
            self.session.stats.record(self.session.step, site.qualified_layer, plan.backend, plan.mode, skipped,
                                      qkv.tile_count(plan.kernel.tile))
        return result.out

    def attend(self, attn: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, role: str,
               **kwargs) -> torch.Tensor:
        """Run one attention call on equal-length ``[B, S, H, D]`` tensors; returns ``[B, S_q, H_q, D]``."""
        qkv = VarlenQKV.from_bshd(query.contiguous(), key.contiguous(), value.contiguous())
        return self.attend_varlen(attn, qkv, role, **kwargs).view(query.shape)
