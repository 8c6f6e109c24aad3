"""``WanTrtllmAttnProcessor`` for ``WanTransformer3DModel`` (Wan 2.1 and 2.2, both A14B experts).

Roles:

- ``self_attn`` (category ``self``): ``attn1``, video tokens with 3-D RoPE (75,600 tokens at 720p/81 frames).
- ``cross_attn`` (category ``cross``): ``attn2``, video queries on the 512 text tokens.
- ``image_cross_attn`` (category ``cross``): Wan 2.1 I2V only, ``attn2``'s second attention on the CLIP image
  tokens (``add_k_proj`` / ``add_v_proj``), added to the text cross-attention's output.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_wan import WanAttnProcessor

from ..plan import RoleTraits
from .base import TrtllmAttnProcessor


class WanTrtllmAttnProcessor(TrtllmAttnProcessor, WanAttnProcessor):
    """diffusers' ``WanAttnProcessor`` with its attention calls on this package's backend."""

    ROLES = {"self_attn": RoleTraits("self"), "cross_attn": RoleTraits("cross"),
             "image_cross_attn": RoleTraits("cross")}
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
        if encoder_hidden_states is None:
            self.announce("self_attn")
        elif attn.add_k_proj is not None:
            self.announce("image_cross_attn", "cross_attn")  # diffusers runs the image attention first
        else:
            self.announce("cross_attn")
        return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
