"""``TrtllmAttnProcessor``: the base of every model's processor.

A model's processor subclasses diffusers' own processor for that model and this base. Its ``__call__`` follows
diffusers' (reusing diffusers' projection and rotary helpers where they are importable) and runs each attention
with :meth:`TrtllmAttnProcessor.attend`, naming the role: the role's planned call travels with the tensors to the
attention op, so no call can take another role's settings, whatever order diffusers' code makes them in.
Parity with diffusers' default processor is tested per model and with diffusers' own model tests.

Two forms:

- installed by :func:`~diffusers_trtllm.enable_trtllm_attention`: one processor per attention layer, planned at
  install (per-layer specs, backend for the GPU, calibrations, timestep gate, statistics);
- ``transformer.set_attn_processor(WanTrtllmAttnProcessor(config))``: one processor for every layer. It does not
  know layer names, the pipeline's timestep or the transformer's calibration, so a config that needs them (layer
  or component keys, ``disabled_until_timestep``, ``target_sparsity``) raises at construction; ``auto`` is
  resolved at the first call of each kind.
"""

from __future__ import annotations

import functools
import inspect
from typing import ClassVar, Mapping

import torch

from ..config import AttentionConfig
from ..dispatch import BACKEND, run_attention
from ..errors import AttentionConfigError
from ..plan import AttentionCall, CallSite, HeadLayout, RoleTraits


class TrtllmAttnProcessor:
    """Base attention processor (see the module docstring for the two forms).

    Args:
        config: an :class:`~diffusers_trtllm.AttentionConfig` (or spec, dict, JSON string) for the unbound form.
        calls: role -> planned :class:`~diffusers_trtllm.plan.AttentionCall` (what ``enable_trtllm_attention``
            passes); ``config`` is then ignored.
    """

    #: role -> traits (category, causal, whether Skip-Softmax / SAGE may apply); keys are what configs target.
    ROLES: ClassVar[dict[str, RoleTraits]] = {}
    #: class names of the attention modules this processor serves.
    ATTENTION_CLASSES: ClassVar[tuple[str, ...]] = ()
    #: class names of the transformers it is made for.
    TRANSFORMER_CLASSES: ClassVar[tuple[str, ...]] = ()
    #: the transformer arguments that carry the raw timestep (read only without a pipeline scheduler).
    TIMESTEP_ARGUMENTS: ClassVar[tuple[str, ...]] = ("timestep",)

    _parallel_config = None

    def __init__(self, config: AttentionConfig | Mapping | str | None = None, *,
                 calls: Mapping[str, AttentionCall] | None = None):
        self.calls = dict(calls) if calls is not None else self._unbound_calls(AttentionConfig.coerce(config))

    @property
    def _attention_backend(self):
        return BACKEND

    @_attention_backend.setter
    def _attention_backend(self, backend) -> None:
        if backend is not None and str(getattr(backend, "value", backend)).lower() == BACKEND.value:
            return
        raise ValueError(
            f"{type(self).__name__} runs attention through the {BACKEND.value!r} backend; to use attention "
            f"backend {backend!r}, restore the model's processors first (handle.restore(), or "
            "transformer.set_attn_processor(saved) with the processors saved before)")

    @classmethod
    def _unbound_calls(cls, config: AttentionConfig) -> dict[str, AttentionCall]:
        role_keys = set(cls.ROLES) | {t.category for t in cls.ROLES.values()}
        other = sorted(set(config.per_role) - role_keys)
        if other:
            raise AttentionConfigError(
                f"per_role keys {other} name layers or components, which {cls.__name__} alone cannot know: install "
                f"with diffusers_trtllm.enable_trtllm_attention(transformer, config), or use role keys "
                f"{sorted(role_keys)}")
        calls = {}
        for role, traits in cls.ROLES.items():
            _, spec = config.resolve("transformer", "*", role, traits.category)
            skip = spec.skip_softmax if traits.sparse_ok and spec.skips else None
            if skip is not None and (skip.disabled_until_timestep > 0 or skip.target_sparsity is not None):
                raise AttentionConfigError(
                    f"{role}: skip_softmax.disabled_until_timestep / target_sparsity need the pipeline's timestep "
                    f"and the transformer's calibration, which {cls.__name__} alone does not see: install with "
                    "diffusers_trtllm.enable_trtllm_attention(pipe, config), or set skip_softmax.threshold only")
            calls[role] = AttentionCall.unplanned(CallSite("transformer", "*", role, traits.category), spec.backend,
                                                  traits.causal, spec.quant if traits.quant_ok else None, skip,
                                                  spec.accuracy)
        return calls

    def attend(self, role: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
               valid_lengths: torch.Tensor | None = None, key_masks: torch.Tensor | None = None) -> torch.Tensor:
        """``role``'s attention of ``[B, S, H, D]`` tensors, as planned for this layer, under diffusers' context
        parallelism where the role takes part in it (:attr:`RoleTraits.context_parallel`): ``valid_lengths`` on
        one process, ``key_masks`` under context parallelism (see :func:`~diffusers_trtllm.dispatch.run_attention`)."""
        parallel = self._parallel_config if self.ROLES[role].context_parallel else None
        return run_attention(self.calls[role], query, key, value, valid_lengths=valid_lengths,
                             parallel_config=parallel, key_masks=key_masks)

    def context_parallel_ranks(self) -> int:
        """The ranks diffusers' context parallelism splits this model's sequence over (0: not enabled)."""
        cp = getattr(self._parallel_config, "context_parallel_config", None)
        return 0 if cp is None else cp.ring_degree * cp.ulysses_degree

    @classmethod
    def context_parallel_plan(cls, transformer: torch.nn.Module) -> dict:
        """The ``cp_plan`` for ``transformer.enable_parallelism``: diffusers' own ``_cp_plan`` of the model."""
        plan = getattr(type(transformer), "_cp_plan", None)
        if plan is None:
            raise AttentionConfigError(f"{type(transformer).__name__} has no context-parallel plan in diffusers "
                                       "and none from diffusers_trtllm")
        return plan

    # --- what install needs to know about a model -------------------------------------------------------------
    @classmethod
    def serves(cls, module: torch.nn.Module) -> bool:
        """Whether this processor takes over ``module``'s attention; other modules keep their processors."""
        return type(module).__name__ in cls.ATTENTION_CLASSES

    @classmethod
    def roles_of(cls, module: torch.nn.Module) -> tuple[str, ...]:
        """The roles of the attention calls ``module`` makes."""
        return tuple(cls.ROLES)

    @classmethod
    def head_layout(cls, module: torch.nn.Module) -> HeadLayout:
        return HeadLayout(module.heads, module.heads, module.inner_dim // module.heads)

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

    def install_hooks(self, transformer: torch.nn.Module) -> list:
        """Forward hooks a model's processors need on the transformer (none by default; picklable objects, never
        holding a call's state); returns their handles."""
        return []


def keys_held_by_every_rank(length: int, ranks: int) -> torch.Tensor:
    """``[ranks, length]`` bool: of a key sequence that every rank holds whole (not split), the tokens each rank's
    shard attends, dealt round-robin, so that the keys of all shards together hold each token once."""
    return torch.arange(length)[None, :] % ranks == torch.arange(ranks)[:, None]


def real_tokens_of_shards(local_length: int, real: int, ranks: int) -> torch.Tensor:
    """``[ranks, local_length]`` bool: of a sequence padded to ``ranks`` equal shards, the tokens of each shard
    before position ``real`` (the rest is padding)."""
    return torch.arange(ranks * local_length).view(ranks, local_length) < real


def bound_arguments(module: torch.nn.Module, args: tuple, kwargs: dict) -> dict:
    """``module.forward``'s arguments of one call by name (what a forward pre-hook with kwargs receives)."""
    try:
        return _forward_signature(type(module)).bind_partial(module, *args, **kwargs).arguments
    except TypeError:
        return kwargs


@functools.lru_cache(maxsize=None)  # one per module class
def _forward_signature(cls: type) -> inspect.Signature:
    return inspect.signature(cls.forward)
