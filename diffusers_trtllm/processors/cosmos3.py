"""``Cosmos3TrtllmAttnProcessor`` for ``Cosmos3OmniTransformer`` (Cosmos 3 Omni).

Each ``layers.N.self_attn`` (``Cosmos3PackedMoTAttention``) runs two attentions over one packed sample (no batch
dimension, no masks; the pipeline calls the transformer once per CFG pass), with grouped-query heads (32 query /
8 key-value heads of 128 in the released model):

- ``und_causal`` (category ``self``): the understanding (text) stream attends causally to itself. It always runs
  dense and unquantized, whatever the config says (a causal text prefix is not where Skip-Softmax or SAGE were
  validated). ``TRTLLM_ATTN`` runs non-causal attention only, so under a ``TRTLLM_ATTN`` default this role runs
  on ``TORCH_SDPA``, said once at install; a ``per_role`` entry for ``und_causal`` (or its category ``self``)
  chooses its backend instead, and one that cannot run causal attention is refused at install.
- ``gen_full`` (category ``joint``): the generation stream (vision, sound, action tokens) attends, non-causally,
  to the text keys and its own keys. Skip-Softmax and SAGE apply here.

Timestep (read only without a pipeline scheduler): per-token ``vision_timesteps`` (and ``sound_timesteps`` /
``action_timesteps``), all the raw scheduler timestep.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_cosmos3 import Cosmos3AttnProcessor

from ..plan import HeadLayout, RoleTraits
from .base import TrtllmAttnProcessor


class Cosmos3TrtllmAttnProcessor(TrtllmAttnProcessor, Cosmos3AttnProcessor):
    """diffusers' ``Cosmos3AttnProcessor`` with both attentions on this package's backend."""

    ROLES = {"und_causal": RoleTraits("self", causal=True, sparse_ok=False, quant_ok=False),
             "gen_full": RoleTraits("joint")}
    ATTENTION_CLASSES = ("Cosmos3PackedMoTAttention",)
    TRANSFORMER_CLASSES = ("Cosmos3OmniTransformer",)
    TIMESTEP_ARGUMENTS = ("vision_timesteps", "sound_timesteps", "action_timesteps")

    @classmethod
    def head_layout(cls, module: torch.nn.Module) -> HeadLayout:
        return HeadLayout(module.num_attention_heads, module.num_key_value_heads, module.head_dim)

    def __call__(self, attn, und_seq: torch.Tensor, gen_seq: torch.Tensor,
                 rotary_emb: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        self.check_module(attn)
        self.announce("und_causal", "gen_full")
        return super().__call__(attn, und_seq, gen_seq, rotary_emb)
