"""``Cosmos3TrtllmAttnProcessor`` for ``Cosmos3OmniTransformer`` (Cosmos 3 Omni).

Each ``layers.N.self_attn`` (``Cosmos3PackedMoTAttention``) runs two attentions over one packed sample (no batch
dimension, no masks; the pipeline calls the transformer once per CFG pass), with grouped-query heads (32 query /
8 key-value heads of 128 in the released model):

- ``und_causal`` (category ``self``): the understanding (text) stream attends causally to itself. It always runs
  dense and unquantized, whatever the config says (a causal text prefix is not where Skip-Softmax or SAGE were
  validated); the plan notes say so. ``TRTLLM_ATTN`` runs non-causal attention only, so give this role a backend
  that runs causal attention (``auto``, ``TORCH_SDPA``) when the default is ``TRTLLM_ATTN``:
  ``{"default": {"backend": "TRTLLM_ATTN", ...}, "per_role": {"und_causal": {"backend": "auto"}}}``.
- ``gen_full`` (category ``joint``): the generation stream (vision, sound, action tokens) attends, non-causally,
  to the text keys and its own keys (e.g. 19,320 queries on 19,920 keys at 720p). Skip-Softmax and SAGE apply here.

Timestep: the transformer gets per-token ``vision_timesteps`` (and ``sound_timesteps`` / ``action_timesteps``
when those modalities are generated), all the raw scheduler timestep; the gate reads their maximum.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_cosmos3 import _rotate_half

from ..backends.base import VarlenQKV
from .base import TrtllmAttnProcessor

NOISY_TIMESTEP_ARGUMENTS = ("vision_timesteps", "sound_timesteps", "action_timesteps")


def read_noisy_timesteps(bound: dict) -> torch.Tensor | None:
    """The timesteps of every noisy token the transformer call gets (the session takes their maximum)."""
    present = [t.flatten() for name in NOISY_TIMESTEP_ARGUMENTS
               if (t := bound.get(name)) is not None and t.numel()]
    return torch.cat(present) if present else None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


class Cosmos3TrtllmAttnProcessor(TrtllmAttnProcessor):
    """Drop-in for diffusers' ``Cosmos3AttnProcessor``: same projections, norms and RoPE per stream; both
    attentions run through the plan, the causal one always dense."""

    ROLES = {"und_causal": "self", "gen_full": "joint"}
    ATTENTION_CLASSES = ("Cosmos3PackedMoTAttention",)
    TRANSFORMER_CLASSES = ("Cosmos3OmniTransformer",)
    read_timestep = staticmethod(read_noisy_timesteps)

    def __call__(self, attn, und_seq: torch.Tensor, gen_seq: torch.Tensor,
                 rotary_emb: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        self.check_module(attn)
        heads, kv_heads, head_dim = attn.num_attention_heads, attn.num_key_value_heads, attn.head_dim
        q_und = attn.norm_q(attn.to_q(und_seq).view(-1, heads, head_dim))
        k_und = attn.norm_k(attn.to_k(und_seq).view(-1, kv_heads, head_dim))
        v_und = attn.to_v(und_seq).view(-1, kv_heads, head_dim)
        k_und_for_gen = attn.k_norm_und_for_gen(k_und) if attn.k_norm_und_for_gen is not None else k_und
        q_gen = attn.norm_added_q(attn.add_q_proj(gen_seq).view(-1, heads, head_dim))
        k_gen = attn.norm_added_k(attn.add_k_proj(gen_seq).view(-1, kv_heads, head_dim))
        v_gen = attn.add_v_proj(gen_seq).view(-1, kv_heads, head_dim)

        cos_und, sin_und, cos_gen, sin_gen = (x.unsqueeze(1) for x in rotary_emb)
        q_und, k_und, k_und_for_gen = (_rotate(x, cos_und, sin_und) for x in (q_und, k_und, k_und_for_gen))
        q_gen, k_gen = (_rotate(x, cos_gen, sin_gen) for x in (q_gen, k_gen))

        und_len, gen_len = q_und.shape[0], q_gen.shape[0]
        causal = VarlenQKV(q_und.contiguous(), k_und.contiguous(), v_und.contiguous(), (und_len,), (und_len,))
        und_out = self.attend_varlen(attn, causal, "und_causal", causal=True, sparse_ok=False, quant_ok=False)
        full = VarlenQKV(q_gen.contiguous(), torch.cat([k_und_for_gen, k_gen]), torch.cat([v_und, v_gen]),
                         (gen_len,), (und_len + gen_len,))
        gen_out = self.attend_varlen(attn, full, "gen_full")
        return attn.to_out(und_out.flatten(-2, -1)), attn.to_add_out(gen_out.flatten(-2, -1))
