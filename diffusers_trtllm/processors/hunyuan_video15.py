"""``HunyuanVideo15TrtllmAttnProcessor`` for ``HunyuanVideo15Transformer3DModel`` (HunyuanVideo 1.5).

Roles:

- ``joint_attn`` (category ``joint``): ``transformer_blocks.N.attn``, one attention over the joint sequence
  ``[video tokens, text tokens]`` (77,585 tokens at 720p/81 frames, 16 heads of 128). Video tokens carry 3-D RoPE;
  text tokens (image, ByT5 and MLLM embeddings, reordered by the transformer so that each sample's valid tokens
  come first) have their own projections (``add_q_proj``...) and no RoPE.

The text mask ``[B, L_text]`` applies to the last ``L_text`` tokens of the joint sequence. diffusers' processor
expands it to a dense ``[B, 1, S, S]`` mask (valid query AND valid key); here each sample becomes one packed
sequence of its valid tokens (all video tokens + its valid text tokens), so the backends see no mask and batches
whose samples have different text lengths run as one ragged call. Padded text positions attend to nothing:
PyTorch's SDPA returns 0 for such fully masked rows, and this processor writes 0 there too, so every output
position matches the default processor (the padded positions never reach a valid token: their keys are masked).

The text refiner (``context_embedder.token_refiner``) uses the same ``Attention`` class with diffusers'
``AttnProcessor2_0`` (2 layers of text self-attention, ~1,000 tokens, once per call: negligible time).
``enable_trtllm_attention`` leaves its processors as they are (:meth:`serves` takes joint attention only);
``transformer.set_attn_processor(HunyuanVideo15TrtllmAttnProcessor(...))`` replaces every processor, and this
processor then hands refiner calls to diffusers' ``AttnProcessor2_0`` unchanged.

Timestep: the pipeline passes ``timestep`` cast to the latent dtype (in bf16, values above 512 are rounded to a
multiple of 4: the gate sees t within 0.002 of the scheduler's).
"""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import AttnProcessor2_0
from diffusers.models.embeddings import apply_rotary_emb

from ..backends.base import VarlenQKV
from ..session import read_timestep_kwarg
from .base import TrtllmAttnProcessor


def _heads(projection: torch.nn.Module, states: torch.Tensor, heads: int) -> torch.Tensor:
    return projection(states).unflatten(2, (heads, -1))


class HunyuanVideo15TrtllmAttnProcessor(TrtllmAttnProcessor):
    """Drop-in for diffusers' ``HunyuanVideo15AttnProcessor2_0``: same projections, QK norms and RoPE; the masked
    joint attention runs as packed sequences through the plan."""

    ROLES = {"joint_attn": "joint"}
    ATTENTION_CLASSES = ("Attention",)
    TRANSFORMER_CLASSES = ("HunyuanVideo15Transformer3DModel",)
    read_timestep = staticmethod(read_timestep_kwarg("timestep"))

    _refiner_processor = AttnProcessor2_0()

    @classmethod
    def serves(cls, module: torch.nn.Module) -> bool:
        # Joint blocks project text with added K/V projections; the text refiner's Attention has none.
        return super().serves(module) and getattr(module, "added_kv_proj_dim", None) is not None

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None,
                 image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.check_module(attn)
        if not self.serves(attn):
            return self._refiner_processor(attn, hidden_states, encoder_hidden_states, attention_mask)
        query = attn.norm_q(_heads(attn.to_q, hidden_states, attn.heads))
        key = attn.norm_k(_heads(attn.to_k, hidden_states, attn.heads))
        value = _heads(attn.to_v, hidden_states, attn.heads)
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)

        if encoder_hidden_states is not None:
            text_query = _heads(attn.add_q_proj, encoder_hidden_states, attn.heads)
            text_key = _heads(attn.add_k_proj, encoder_hidden_states, attn.heads)
            text_value = _heads(attn.add_v_proj, encoder_hidden_states, attn.heads)
            if attn.norm_added_q is not None:
                text_query = attn.norm_added_q(text_query)
            if attn.norm_added_k is not None:
                text_key = attn.norm_added_k(text_key)
            query = torch.cat([query, text_query], dim=1)
            key = torch.cat([key, text_key], dim=1)
            value = torch.cat([value, text_value], dim=1)

        out = self.attend_masked(attn, query, key, value, attention_mask).flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is None:
            return out, None  # as diffusers' processor: no output projection without text
        text_len = encoder_hidden_states.shape[1]
        video_out, text_out = out[:, :-text_len], out[:, -text_len:]
        if getattr(attn, "to_out", None) is not None:
            video_out = attn.to_out[1](attn.to_out[0](video_out))
        if getattr(attn, "to_add_out", None) is not None:
            text_out = attn.to_add_out(text_out)
        return video_out, text_out

    def attend_masked(self, attn, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      text_mask: torch.Tensor | None) -> torch.Tensor:
        """Joint attention of ``[B, S, H, D]`` tensors among each sample's valid tokens; ``text_mask [B, M]``
        marks the valid ones among the last M tokens (the others are valid). Returns ``[B, S, H, D]`` with 0 at
        invalid positions."""
        batch, seq_len = query.shape[:2]
        if text_mask is None or bool(text_mask.all()):
            return self.attend(attn, query, key, value, "joint_attn")
        valid = torch.nn.functional.pad(text_mask.bool(), (seq_len - text_mask.shape[1], 0), value=True)
        lengths = tuple(valid.sum(dim=1).tolist())
        index = valid.flatten().nonzero().squeeze(1)
        # Gathering by index packs each sample's valid tokens in order, whatever the mask's layout.
        packed = [x.flatten(0, 1).index_select(0, index) for x in (query, key, value)]
        out = self.attend_varlen(attn, VarlenQKV(*packed, lengths, lengths), "joint_attn")
        full = out.new_zeros(batch * seq_len, *out.shape[1:]).index_copy_(0, index, out)
        return full.view(batch, seq_len, *out.shape[1:])
