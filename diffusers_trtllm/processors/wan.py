"""``WanTrtllmAttnProcessor`` for ``WanTransformer3DModel`` (Wan 2.1 and 2.2, both A14B experts).

Roles:

- ``self_attn`` (category ``self``): ``attn1``, video tokens with 3-D RoPE (75,600 tokens at 720p/81 frames).
- ``cross_attn`` (category ``cross``): ``attn2``, video queries on the 512 text tokens.
- ``image_cross_attn`` (category ``cross``): Wan 2.1 I2V only, ``attn2``'s second attention on the CLIP image
  tokens (``add_k_proj`` / ``add_v_proj``), added to the text cross-attention's output.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_wan import _get_added_kv_projections, _get_qkv_projections

from .base import TrtllmAttnProcessor

WAN_TEXT_TOKENS = 512  # diffusers hard-codes the text context length the same way


def apply_wan_rotary(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotary embedding on interleaved channel pairs of ``x [B, S, H, D]`` (same arithmetic as diffusers)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


class WanTrtllmAttnProcessor(TrtllmAttnProcessor):
    """Drop-in for diffusers' ``WanAttnProcessor``: same projections, norms and RoPE; attention through the plan."""

    ROLES = {"self_attn": "self", "cross_attn": "cross", "image_cross_attn": "cross"}
    ATTENTION_CLASSES = ("WanAttention",)
    TRANSFORMER_CLASSES = ("WanTransformer3DModel",)

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None,
                 rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        self.check_module(attn)
        if attention_mask is not None:
            raise NotImplementedError("WanTrtllmAttnProcessor: Wan passes no attention_mask; got one of shape "
                                      f"{tuple(attention_mask.shape)}")
        image_states = None
        if attn.add_k_proj is not None:
            image_len = encoder_hidden_states.shape[1] - WAN_TEXT_TOKENS
            image_states = encoder_hidden_states[:, :image_len]
            encoder_hidden_states = encoder_hidden_states[:, image_len:]

        query, key, value = _get_qkv_projections(attn, hidden_states, encoder_hidden_states)
        query = attn.norm_q(query).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(key).unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        if rotary_emb is not None:
            query = apply_wan_rotary(query, *rotary_emb)
            key = apply_wan_rotary(key, *rotary_emb)

        image_out = None
        if image_states is not None:
            key_img, value_img = _get_added_kv_projections(attn, image_states)
            key_img = attn.norm_added_k(key_img).unflatten(2, (attn.heads, -1))
            value_img = value_img.unflatten(2, (attn.heads, -1))
            image_out = self.attend(attn, query, key_img, value_img, "image_cross_attn").flatten(2, 3)

        role = "self_attn" if encoder_hidden_states is None else "cross_attn"
        out = self.attend(attn, query, key, value, role).flatten(2, 3).type_as(query)
        if image_out is not None:
            out = out + image_out.type_as(query)
        out = attn.to_out[0](out)
        return attn.to_out[1](out)
