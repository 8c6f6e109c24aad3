"""``WanTrtllmAttnProcessor`` for ``WanTransformer3DModel`` (Wan 2.1 and 2.2, both A14B experts).

Roles:

- ``self_attn`` (category ``self``): ``attn1``, video tokens with 3-D RoPE (75,600 tokens at 720p/81 frames).
- ``cross_attn`` (category ``cross``): ``attn2``, video queries on the 512 text tokens.
- ``image_cross_attn`` (category ``cross``): Wan 2.1 I2V only, ``attn2``'s second attention on the CLIP image
  tokens (``add_k_proj`` / ``add_v_proj``), added to the text cross-attention's output.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_wan import (WanAttnProcessor, _get_added_kv_projections,
                                                           _get_qkv_projections)

from ..plan import RoleTraits
from .base import TrtllmAttnProcessor

#: Text tokens at the end of an I2V cross-attention's context (the image tokens come first), as diffusers fixes it.
WAN_TEXT_TOKENS = 512


def _rotary(states: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """Wan's interleaved rotary embedding (diffusers defines it inside its processor, where it cannot be imported)."""
    x1, x2 = states.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = freqs_cos[..., 0::2], freqs_sin[..., 1::2]
    out = torch.empty_like(states)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(states)


class WanTrtllmAttnProcessor(TrtllmAttnProcessor, WanAttnProcessor):
    """diffusers' ``WanAttnProcessor`` with each attention on this package's op, under its role's plan."""

    # diffusers keeps cross-attention out of the context-parallel all-to-all (its PR 12909)
    ROLES = {"self_attn": RoleTraits("self"),
             "cross_attn": RoleTraits("cross", queries_outnumber_keys=True, context_parallel=False),
             "image_cross_attn": RoleTraits("cross", queries_outnumber_keys=True, context_parallel=False)}
    ATTENTION_CLASSES = ("WanAttention",)
    TRANSFORMER_CLASSES = ("WanTransformer3DModel",)

    @classmethod
    def roles_of(cls, module: torch.nn.Module) -> tuple[str, ...]:
        if not module.is_cross_attention:
            return ("self_attn",)
        return ("image_cross_attn", "cross_attn") if module.add_k_proj is not None else ("cross_attn",)

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None,
                 rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        self.check_module(attn)
        if attention_mask is not None:
            raise ValueError(f"{type(self).__name__} takes no attention_mask (Wan's transformer passes none; got "
                             f"one shaped {tuple(attention_mask.shape)})")
        image_states = None
        if attn.add_k_proj is not None:
            image_tokens = encoder_hidden_states.shape[1] - WAN_TEXT_TOKENS
            image_states = encoder_hidden_states[:, :image_tokens]
            encoder_hidden_states = encoder_hidden_states[:, image_tokens:]
        query, key, value = _get_qkv_projections(attn, hidden_states, encoder_hidden_states)
        query = attn.norm_q(query).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(key).unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        if rotary_emb is not None:
            query, key = _rotary(query, *rotary_emb), _rotary(key, *rotary_emb)

        image_out = None
        if image_states is not None:
            image_key, image_value = _get_added_kv_projections(attn, image_states)
            image_key = attn.norm_added_k(image_key).unflatten(2, (attn.heads, -1))
            image_value = image_value.unflatten(2, (attn.heads, -1))
            image_out = self.attend("image_cross_attn", query, image_key, image_value)
            image_out = image_out.flatten(2, 3).type_as(query)
        if encoder_hidden_states is None:
            out = self.attend("self_attn", query, key, value)
        else:
            out = self.attend("cross_attn", query, key, value)
        out = out.flatten(2, 3).type_as(query)
        if image_out is not None:
            out = out + image_out
        return attn.to_out[1](attn.to_out[0](out))
