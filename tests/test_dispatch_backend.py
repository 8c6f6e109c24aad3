"""The ``"trtllm"`` backend of diffusers' attention dispatcher on a model this package has no processor for (a
tiny Flux): parity with diffusers' native backend, both ways in, and the calls it refuses.

Tolerance: float32 throughout; TORCH_SDPA is the same PyTorch SDPA diffusers' native backend calls and
TORCH_REFERENCE a tiled online softmax, which sums in another order: both agree with native to a few float32
rounding steps (observed ~1e-6 relative), so 1e-5 relative.
"""

import pytest
import torch
from diffusers import FluxTransformer2DModel
from diffusers.models.attention_dispatch import _AttentionBackendRegistry, attention_backend, dispatch_attention_fn

from diffusers_trtllm import AttentionConfigError, BackendUnavailableError, enable_trtllm_attention, set_dispatch_config
from diffusers_trtllm.dispatch import BACKEND, trtllm_attention

from helpers import max_rel_err, tiny_wan

TOLERANCE = 1e-5
TEXT_TOKENS, IMAGE_TOKENS = 7, 16


@pytest.fixture(autouse=True)
def _reset_dispatch_config():
    # model.set_attention_backend also sets diffusers' process-wide active backend: restore it, or later tests'
    # models without an explicit backend would run on "trtllm"
    active = _AttentionBackendRegistry.get_active_backend()[0]
    yield
    set_dispatch_config(None)
    _AttentionBackendRegistry.set_active_backend(active)


def tiny_flux():
    """One double-stream and one single-stream block, 2 heads of 16 channels."""
    return FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                  attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                  pooled_projection_dim=32, guidance_embeds=False, axes_dims_rope=(4, 6, 6)).eval()


def flux_inputs(batch=2):
    return dict(hidden_states=torch.randn(batch, IMAGE_TOKENS, 4),
                encoder_hidden_states=torch.randn(batch, TEXT_TOKENS, 32), pooled_projections=torch.randn(batch, 32),
                timestep=torch.full((batch,), 0.5), img_ids=torch.randn(IMAGE_TOKENS, 3),
                txt_ids=torch.zeros(TEXT_TOKENS, 3), return_dict=False)


def run(model, inputs):
    with torch.no_grad():
        return model(**inputs)[0]


@pytest.mark.parametrize("backend", ["TORCH_REFERENCE", "TORCH_SDPA"])
def test_set_attention_backend_matches_native(backend):
    model, inputs = tiny_flux(), flux_inputs()
    native = run(model, inputs)
    set_dispatch_config({"default": {"backend": backend}})
    model.set_attention_backend("trtllm")
    assert max_rel_err(run(model, inputs), native) <= TOLERANCE


def test_attention_backend_context_matches_native():
    model, inputs = tiny_flux(), flux_inputs()
    native = run(model, inputs)
    set_dispatch_config({"default": {"backend": "TORCH_REFERENCE"}})
    with attention_backend("trtllm"):
        got = run(model, inputs)
    assert max_rel_err(got, native) <= TOLERANCE


def test_dispatch_config_features_reach_the_call():
    """The default spec's Skip-Softmax and SAGE reach the reference: int8 Q/K change the output (the tiny
    sequences fit in one skip tile, so λ alone would not)."""
    model, inputs = tiny_flux(), flux_inputs()
    model.set_attention_backend("trtllm")
    set_dispatch_config({"default": {"backend": "TORCH_REFERENCE"}})
    dense = run(model, inputs)
    set_dispatch_config({"default": {"backend": "TORCH_REFERENCE", "skip_softmax": {"threshold": 0.9},
                                     "quant": {"dtype_qk": "int8"}}})
    assert max_rel_err(run(model, inputs), dense) > 1e-3


def attention_call(**kwargs):
    q = torch.randn(1, 8, 2, 16)
    return dispatch_attention_fn(q, q, q, backend=BACKEND, **kwargs)


def test_incompatible_calls_raise():
    set_dispatch_config({"default": {"backend": "TORCH_REFERENCE"}})
    with pytest.raises(ValueError, match="takes no attn_mask .*shaped \\(1, 1, 8, 8\\).*'native'"):
        attention_call(attn_mask=torch.ones(1, 1, 8, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="has no dropout \\(dropout_p=0.1\\)"):
        attention_call(dropout_p=0.1)
    assert attention_call().shape == (1, 8, 2, 16)


def test_the_dispatcher_returns_the_log_sum_exp_where_its_backend_gives_it():
    """diffusers' ring attention asks ``return_lse``: the reference gives each row's log-sum-exp of its scaled
    scores; TORCH_SDPA cannot, and says which backend can."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 40, 2, 16, generator=g, dtype=torch.float64) for _ in range(3))
    set_dispatch_config({"default": {"backend": "TORCH_REFERENCE"}})
    out, lse = trtllm_attention(q, k, v, scale=0.25, return_lse=True)
    exact = torch.logsumexp(torch.einsum("bqhd,bkhd->bqhk", q, k) * 0.25, dim=-1)
    torch.testing.assert_close(lse, exact.float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=0.25).transpose(1, 2))
    set_dispatch_config({"default": {"backend": "TORCH_SDPA"}})
    with pytest.raises(BackendUnavailableError, match=r"TORCH_SDPA does not return the log-sum-exp that ring "
                                                      r"attention merges partial results by; TORCH_REFERENCE and TRTLLM_ATTN do"):
        trtllm_attention(q, k, v, return_lse=True)


@pytest.mark.parametrize("config, match", [
    ({"per_role": {"self": {"backend": "TORCH_SDPA"}}}, r"per_role keys \['self'\] need this package's processors"),
    ({"default": {"skip_softmax": {"threshold": 0.1, "disabled_until_timestep": 0.5}}},
     "disabled_until_timestep, target_sparsity and reuse_steps need the pipeline's steps, timestep"),
    ({"default": {"skip_softmax": {"threshold": 0.1, "reuse_steps": 2}}}, "and reuse_steps need the pipeline's steps"),
    ({"default": {"skip_softmax": {"target_sparsity": 0.5}}}, "set_dispatch_config takes skip_softmax.threshold only"),
], ids=["per_role", "gate", "reuse", "target_sparsity"])
def test_set_dispatch_config_refuses_what_needs_processors(config, match):
    with pytest.raises(AttentionConfigError, match=match):
        set_dispatch_config(config)


def test_another_backend_on_a_model_with_this_packages_processors_raises():
    model = tiny_wan()
    handle = enable_trtllm_attention(model, {"default": {"backend": "TORCH_SDPA"}})
    with pytest.raises(ValueError, match="restore the model's processors first"):
        model.set_attention_backend("native")
    model.set_attention_backend("trtllm")  # its own backend is accepted
    handle.restore()
    model.set_attention_backend("native")  # after restore, any backend


@pytest.mark.parametrize("queries,keys", [(7, 7), (5, 9)])
def test_planned_sdpa_runs_the_backends_causal_alignment(queries, keys):
    """A call planned on TORCH_SDPA runs SDPA outside the op (differentiable, traced by inductor); it computes what
    the op's TORCH_SDPA backend does, causal bottom-right included, as the float64 reference."""
    from diffusers_trtllm.backends.reference import reference_attention
    from diffusers_trtllm.dispatch import run_attention
    from diffusers_trtllm.plan import AttentionCall, CallSite

    torch.manual_seed(0)
    q = torch.randn(1, queries, 2, 64, dtype=torch.float64)
    k, v = (torch.randn(1, keys, 2, 64, dtype=torch.float64) for _ in range(2))
    site = CallSite("*", "*", "attention", "*")
    planned = AttentionCall(site, "TORCH_SDPA", True, None, None, planned=True)
    through_op = AttentionCall.unplanned(site, "TORCH_SDPA", True, None, None)
    out_planned = run_attention(planned, q, k, v)
    out_op = run_attention(through_op, q, k, v)
    ref, _, _ = reference_attention(q[0], k[0], v[0], 64 ** -0.5, causal=True)
    torch.testing.assert_close(out_planned, out_op, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out_planned[0], ref, rtol=1e-10, atol=1e-10)
