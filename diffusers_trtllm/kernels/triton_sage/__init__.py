"""SAGE attention with Skip-Softmax for Hopper (sm_90): the package's own fused Triton kernels.

TRT-LLM FMHAv2's SAGE kernel (:mod:`..fmha_v2_sage`) serves fp8 self-attention with Q blocks of 64 tokens; these
kernels serve int8, Q/K blocks of 1, 4 or 16 tokens and unequal query and key lengths, and count skipped tiles.
They implement exactly the semantics of :mod:`diffusers_trtllm.quant` and
:func:`diffusers_trtllm.backends.reference.reference_attention`, so that Skip-Softmax calibrations made with the
reference transfer, tile for tile at the kernel's skip tile.

- :mod:`.quantize`: the quantizer (two launches), also feeding the FMHAv2 SAGE kernel;
- :mod:`.attention`: the attention kernel (one launch dense, up to three with sampled skipping), optionally giving
  each row's log-sum-exp and reusing skip decisions across calls (a tile map, :func:`tile_map_shape`);
- :mod:`.launch`: tile shapes, skip schedules and the rule that decides where skipping pays.

Runs where Triton has fp8 tensor-core dots: sm_89 and newer (tuned on sm_90). Under ``TRITON_INTERPRET=1`` the same
kernels run on the CPU (slowly; for tests).
"""

from .attention import (sage_attention_quantized, tile_map_shape, triton_sage_attention,
                        triton_sage_unavailable_reason)
from .launch import (BRANCH_FREE_BELOW, DENSE_LAUNCH, SKIP_PAYS_FROM, SKIP_SAMPLE_WAVES, AttentionLaunch, skip_launch,
                     skip_sample_rule)
from .quantize import V_TOKEN_ALIGN, QuantizeTargets, SageQuantized, quantize_into, sage_quantize, v_columns

__all__ = [
    "BRANCH_FREE_BELOW", "DENSE_LAUNCH", "SKIP_PAYS_FROM", "SKIP_SAMPLE_WAVES", "V_TOKEN_ALIGN",
    "AttentionLaunch", "QuantizeTargets", "SageQuantized", "quantize_into", "sage_attention_quantized",
    "sage_quantize", "skip_launch", "skip_sample_rule", "tile_map_shape", "triton_sage_attention",
    "triton_sage_unavailable_reason", "v_columns",
]
