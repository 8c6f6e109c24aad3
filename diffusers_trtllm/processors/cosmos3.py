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
from diffusers.models.transformers.transformer_cosmos3 import Cosmos3AttnProcessor, _rotate_half

from ..plan import HeadLayout, RoleTraits
from .base import TrtllmAttnProcessor


def _rotary(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return states * cos + _rotate_half(states) * sin


class Cosmos3TrtllmAttnProcessor(TrtllmAttnProcessor, Cosmos3AttnProcessor):
    """diffusers' ``Cosmos3AttnProcessor`` with both attentions on this package's op, each under its role's plan."""

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
        heads_q, heads_kv, head_dim = attn.num_attention_heads, attn.num_key_value_heads, attn.head_dim
        q_und = attn.norm_q(attn.to_q(und_seq).view(-1, heads_q, head_dim))
        k_und = attn.norm_k(attn.to_k(und_seq).view(-1, heads_kv, head_dim))
        v_und = attn.to_v(und_seq).view(-1, heads_kv, head_dim)
        q_gen = attn.norm_added_q(attn.add_q_proj(gen_seq).view(-1, heads_q, head_dim))
        k_gen = attn.norm_added_k(attn.add_k_proj(gen_seq).view(-1, heads_kv, head_dim))
        v_gen = attn.add_v_proj(gen_seq).view(-1, heads_kv, head_dim)
        k_und_for_gen = attn.k_norm_und_for_gen(k_und) if attn.k_norm_und_for_gen is not None else None

        cos_und, sin_und, cos_gen, sin_gen = (x.unsqueeze(1) for x in rotary_emb)
        q_und, k_und = _rotary(q_und, cos_und, sin_und), _rotary(k_und, cos_und, sin_und)
        # Text keys without a norm of their own for the generation stream are the text stream's: diffusers rotates
        # them a second time (the same values), this reuses them.
        k_und_for_gen = k_und if k_und_for_gen is None else _rotary(k_und_for_gen, cos_und, sin_und)
        q_gen, k_gen = _rotary(q_gen, cos_gen, sin_gen), _rotary(k_gen, cos_gen, sin_gen)

        und_out = self.attend("und_causal", q_und[None], k_und[None], v_und[None])
        gen_out = self.attend("gen_full", q_gen[None], torch.cat([k_und_for_gen, k_gen])[None],
                              torch.cat([v_und, v_gen])[None])
        return attn.to_out(und_out[0].flatten(-2, -1)), attn.to_add_out(gen_out[0].flatten(-2, -1))
