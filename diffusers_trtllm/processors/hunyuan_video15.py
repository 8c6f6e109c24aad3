"""``HunyuanVideo15TrtllmAttnProcessor`` for ``HunyuanVideo15Transformer3DModel`` (HunyuanVideo 1.5).

Role ``joint_attn`` (category ``joint``): ``transformer_blocks.N.attn``, one attention over the joint sequence
``[video tokens, text tokens]`` (77,585 tokens at 720p/81 frames, 16 heads of 128). Video tokens carry 3-D RoPE;
text tokens (image, ByT5 and MLLM embeddings, reordered by the transformer so that each sample's valid tokens come
first) have their own projections and no RoPE.

The text mask ``[B, L_text]`` marks each sample's valid text tokens. diffusers' processor expands it to a dense
``[B, 1, S, S]`` mask (6 GB of booleans per block at 720p); this processor instead lets each sample attend among
its valid prefix (all video tokens + its valid text tokens), which the attention op packs into one ragged call.
Padded positions get 0, as PyTorch's SDPA gives fully masked rows; they never reach a valid token. The valid
lengths are read on the host once per transformer call, by a pre-hook on the first block that binds its
``attention_mask`` argument by name and keeps them on that mask tensor, which the transformer builds anew for
each call and passes to every block: they belong to the call, whichever thread makes it. The processors of the
other blocks reuse them (the unbound ``set_attn_processor`` form reads the mask where it arrives). The
projections are diffusers' modules and ``apply_rotary_emb``, in diffusers' order; only the mask handling
differs, which is why this processor has its own ``__call__``.

Context parallelism (:meth:`HunyuanVideo15TrtllmAttnProcessor.context_parallel_plan`; diffusers 0.42.1's model has
no ``_cp_plan``): the video tokens and their RoPE are split over the ranks, the text is not (HunyuanVideo 1.5's
1,985 text tokens divide by no even rank count). Each rank's joint sequence is then ``[its video shard, all text]``;
its key mask keeps its video shard and every ``ranks``-th valid text token (round-robin), so that ring and Ulysses
attend each valid text token once and padded text never. The padded text rows' outputs are then not 0 but
attention over valid keys; like the 0s, they never reach a valid token.

The text refiner (``context_embedder.token_refiner``) uses the same ``Attention`` class with diffusers'
``AttnProcessor2_0``; ``enable_trtllm_attention`` leaves it as it is, and the unbound form hands refiner calls to
``AttnProcessor2_0`` unchanged.
"""

from __future__ import annotations


import torch
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput
from diffusers.models.attention_processor import AttnProcessor2_0
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0

from ..plan import RoleTraits
from .base import TrtllmAttnProcessor, bound_arguments, keys_held_by_every_rank


#: the attribute of a transformer call's text mask that holds its valid tokens per sample (int CPU tensor)
VALID_TOKENS_ATTRIBUTE = "_diffusers_trtllm_valid_tokens"


def valid_text_tokens(text_mask: torch.Tensor) -> torch.Tensor:
    """Each sample's valid text tokens under ``text_mask`` ``[B, L_text]``, on the host (one read)."""
    return text_mask.sum(dim=1).cpu()


class TextLengthsReader:
    """The first joint block's forward pre-hook: reads the call's valid text tokens once, onto its mask."""

    def __call__(self, block, args, kwargs) -> None:
        mask = bound_arguments(block, args, kwargs).get("attention_mask")
        if mask is not None:
            setattr(mask, VALID_TOKENS_ATTRIBUTE, valid_text_tokens(mask))


def _heads(projection: torch.nn.Module, states: torch.Tensor, heads: int) -> torch.Tensor:
    return projection(states).unflatten(2, (heads, -1))


class HunyuanVideo15TrtllmAttnProcessor(TrtllmAttnProcessor, HunyuanVideo15AttnProcessor2_0):
    """diffusers' ``HunyuanVideo15AttnProcessor2_0`` projections; the masked joint attention as packed
    sequences on this package's backend."""

    ROLES = {"joint_attn": RoleTraits("joint")}
    ATTENTION_CLASSES = ("Attention",)
    TRANSFORMER_CLASSES = ("HunyuanVideo15Transformer3DModel",)

    _refiner_processor = AttnProcessor2_0()

    @classmethod
    def serves(cls, module: torch.nn.Module) -> bool:
        # Joint blocks project text with added K/V projections; the text refiner's Attention has none.
        return super().serves(module) and getattr(module, "added_kv_proj_dim", None) is not None

    @classmethod
    def context_parallel_plan(cls, transformer: torch.nn.Module) -> dict:
        """Split the video tokens (after patch embedding) and their RoPE, gather the output projection; the text
        stays whole on every rank (see the module docstring)."""
        rope = ContextParallelInput(split_dim=0, expected_dims=2, split_output=True)  # cos, sin: [video tokens, D]
        return {"rope": {0: rope, 1: rope},
                "transformer_blocks.0": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3)},
                "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3)}

    def install_hooks(self, transformer: torch.nn.Module) -> list:
        return [transformer.transformer_blocks[0].register_forward_pre_hook(TextLengthsReader(), with_kwargs=True)]

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

        ranks = self.context_parallel_ranks()
        if ranks and encoder_hidden_states is not None:
            out = self.attend("joint_attn", query, key, value, key_masks=self._key_masks(
                attention_mask, ranks, hidden_states.shape[:2], encoder_hidden_states.shape[1]))
        else:
            out = self.attend("joint_attn", query, key, value,
                              valid_lengths=self._valid_lengths(attention_mask, query.shape[1]))
        out = out.flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is None:
            return out, None
        text_len = encoder_hidden_states.shape[1]
        video_out, text_out = out[:, :-text_len], out[:, -text_len:]
        if getattr(attn, "to_out", None) is not None:
            video_out = attn.to_out[1](attn.to_out[0](video_out))
        if getattr(attn, "to_add_out", None) is not None:
            text_out = attn.to_add_out(text_out)
        return video_out, text_out

    @staticmethod
    def _key_masks(text_mask: torch.Tensor | None, ranks: int, video_shape: torch.Size, text_len: int) -> torch.Tensor:
        """``[ranks, B, video shard + text]``: each rank's video shard, and its round-robin share of valid text."""
        batch, video_len = video_shape
        text = keys_held_by_every_rank(text_len, ranks)[:, None, :].expand(ranks, batch, text_len)
        if text_mask is not None:
            if text_mask.shape[1] != text_len:
                raise ValueError(f"the text mask has {text_mask.shape[1]} tokens but this rank holds {text_len} text "
                                 "tokens: enable context parallelism with diffusers_trtllm.context_parallel_plan("
                                 "transformer), which keeps the text whole on every rank")
            counts = getattr(text_mask, VALID_TOKENS_ATTRIBUTE, None)
            counts = valid_text_tokens(text_mask) if counts is None else counts
            text = text & (torch.arange(text_len)[None, :] < counts[:, None])  # valid tokens come first
        return torch.cat([torch.ones(ranks, batch, video_len, dtype=torch.bool), text], dim=2)

    def _valid_lengths(self, text_mask: torch.Tensor | None, seq_len: int) -> torch.Tensor | None:
        if text_mask is None:
            return None
        counts = getattr(text_mask, VALID_TOKENS_ATTRIBUTE, None)
        if counts is None:  # the unbound form: no pre-hook read them
            counts = valid_text_tokens(text_mask)
        return counts + (seq_len - text_mask.shape[1])
