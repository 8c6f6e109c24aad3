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

Context parallelism (:meth:`Cosmos3TrtllmAttnProcessor.context_parallel_plan`): diffusers splits Cosmos 3 outside
its model, through the seams ``_cp_shard_fn`` / ``_cp_gather_fn``, because the generation stream must be padded to
a multiple of the ranks, which a declarative ``cp_plan`` cannot do. The plan sets both seams on the transformer
(:class:`Cosmos3ContextParallel`) and is itself empty: the generation stream and its RoPE are padded and split over
the ranks, the text stream stays whole on every rank (a few hundred tokens; its causal attention then runs on each
rank as on one process, outside diffusers' templates, which refuse causal attention). ``gen_full``'s key mask keeps
each rank's real generation tokens and its round-robin share of the text keys, so that ring and Ulysses attend
every key once and padding never. Grouped-query heads run as they are (Ulysses splits both head counts).

Timestep (read only without a pipeline scheduler): per-token ``vision_timesteps`` (and ``sound_timesteps`` /
``action_timesteps``), all the raw scheduler timestep.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist
from diffusers.hooks.context_parallel import EquipartitionSharder
from diffusers.models.transformers.transformer_cosmos3 import Cosmos3AttnProcessor, _rotate_half

from ..plan import HeadLayout, RoleTraits
from .base import TrtllmAttnProcessor, keys_held_by_every_rank, real_tokens_of_shards

#: the attribute of a call's split generation-stream RoPE (``rotary_emb[2]``) that holds the stream's real length
GEN_TOKENS_ATTRIBUTE = "_diffusers_trtllm_gen_tokens"


def _rotary(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return states * cos + _rotate_half(states) * sin


class Cosmos3TrtllmAttnProcessor(TrtllmAttnProcessor, Cosmos3AttnProcessor):
    """diffusers' ``Cosmos3AttnProcessor`` with both attentions on this package's op, each under its role's plan."""

    # the text stream is never split (see the module docstring): its attention stays out of context parallelism
    ROLES = {"und_causal": RoleTraits("self", causal=True, sparse_ok=False, quant_ok=False, context_parallel=False),
             "gen_full": RoleTraits("joint")}
    ATTENTION_CLASSES = ("Cosmos3PackedMoTAttention",)
    TRANSFORMER_CLASSES = ("Cosmos3OmniTransformer",)
    TIMESTEP_ARGUMENTS = ("vision_timesteps", "sound_timesteps", "action_timesteps")

    @classmethod
    def head_layout(cls, module: torch.nn.Module) -> HeadLayout:
        return HeadLayout(module.num_attention_heads, module.num_key_value_heads, module.head_dim)

    @classmethod
    def context_parallel_plan(cls, transformer: torch.nn.Module) -> dict:
        """Set the transformer's shard and gather seams (:class:`Cosmos3ContextParallel`, idle until
        ``enable_parallelism``); the ``cp_plan`` itself is empty."""
        seams = Cosmos3ContextParallel(transformer)
        transformer._cp_shard_fn, transformer._cp_gather_fn = seams.shard, seams.gather
        return {}

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
                              torch.cat([v_und, v_gen])[None], key_masks=self._key_masks(rotary_emb, q_und.shape[0]))
        return attn.to_out(und_out[0].flatten(-2, -1)), attn.to_add_out(gen_out[0].flatten(-2, -1))

    def _key_masks(self, rotary_emb, und_len: int) -> torch.Tensor | None:
        """Under context parallelism, ``[ranks, 1, text + generation shard]``: each rank's share of the text keys
        and its real generation tokens."""
        ranks = self.context_parallel_ranks()
        if not ranks:
            return None
        gen_len = getattr(rotary_emb[2], GEN_TOKENS_ATTRIBUTE, None)
        if gen_len is None:
            raise ValueError("Cosmos 3 under context parallelism needs the shard seams of "
                             "diffusers_trtllm.context_parallel_plan(transformer), passed as enable_parallelism's "
                             "cp_plan; this call's sequence was not split by them")
        local = rotary_emb[2].shape[0]
        return torch.cat([keys_held_by_every_rank(und_len, ranks), real_tokens_of_shards(local, gen_len, ranks)],
                         dim=1)[:, None]


class Cosmos3ContextParallel:
    """Cosmos 3's context-parallel seams (``transformer._cp_shard_fn`` / ``_cp_gather_fn``, which its ``forward``
    calls around the decoder layers): the generation stream and its RoPE zero-padded to a multiple of the ranks and
    split; the text stream whole on every rank; the generation output gathered and unpadded. Idle (identity) while
    the transformer has no context-parallel config."""

    #: the real generation length between a call's shard and gather (one pending call per thread)
    _pending = threading.local()

    def __init__(self, transformer: torch.nn.Module):
        self.transformer = transformer

    def _mesh(self):
        cp = getattr(self.transformer._parallel_config, "context_parallel_config", None)
        return None if cp is None else cp._flattened_mesh

    def shard(self, und_seq: torch.Tensor, gen_seq: torch.Tensor, rotary_emb: tuple):
        mesh = self._mesh()
        if mesh is None:
            return und_seq, gen_seq, rotary_emb
        ranks, rank = mesh.size(), dist.get_rank(mesh.get_group())
        gen_len = gen_seq.shape[0]
        pad = -gen_len % ranks
        cos_und, sin_und, cos_gen, sin_gen = rotary_emb
        gen_seq, cos_gen, sin_gen = (torch.nn.functional.pad(x, (0, 0, 0, pad)).chunk(ranks)[rank]
                                     for x in (gen_seq, cos_gen, sin_gen))
        setattr(cos_gen, GEN_TOKENS_ATTRIBUTE, gen_len)
        self._pending.gen_len = gen_len
        return und_seq, gen_seq, (cos_und, sin_und, cos_gen, sin_gen)

    def gather(self, und_out: torch.Tensor, gen_out: torch.Tensor):
        mesh = self._mesh()
        if mesh is None:
            return und_out, gen_out
        return und_out, EquipartitionSharder.unshard(gen_out, 0, mesh)[:self._pending.gen_len]
