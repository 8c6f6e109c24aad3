"""TRTLLM_ATTN's declared constraints: every refusal, on CPU, with the GPU architecture monkeypatched."""

import types

import pytest
import torch

from diffusers_trtllm.backends import get_backend, select_backend, trtllm
from diffusers_trtllm.backends.base import KernelPlan, VarlenQKV
from diffusers_trtllm.config import TRTLLM_ATTN, AttnQuantSpec
from diffusers_trtllm.errors import BackendUnavailableError
from diffusers_trtllm.kernels import flashinfer_fmha

SCALE = 128 ** -0.5


def make_qkv(seqlens_q=(256, 384), seqlens_kv=None, heads_q=4, heads_kv=4, head_dim=128, dtype=torch.bfloat16):
    seqlens_kv = seqlens_q if seqlens_kv is None else seqlens_kv
    q = torch.zeros(sum(seqlens_q), heads_q, head_dim, dtype=dtype)
    kv = torch.zeros(sum(seqlens_kv), heads_kv, head_dim, dtype=dtype)
    return VarlenQKV(q, kv, kv.clone(), tuple(seqlens_q), tuple(seqlens_kv))


def plan(**kw):
    return KernelPlan(TRTLLM_ATTN, SCALE, **kw)


@pytest.fixture
def flashinfer_ok(monkeypatch):
    """Pretend an adequate FlashInfer is installed (the refusals under test are not about it)."""
    monkeypatch.setattr(trtllm, "flashinfer_unavailable_reason", lambda function: None)


def on_arch(monkeypatch, arch):
    monkeypatch.setattr(trtllm, "gpu_arch", lambda device: arch)


def test_registered_with_priority():
    backend = get_backend(TRTLLM_ATTN)
    assert backend.priority == 10 and backend.runner is trtllm.run


def test_cpu_tensors_refused_for_the_device_before_anything_else():
    reason = trtllm.unavailable_reason(plan(), make_qkv(head_dim=16))  # head_dim 16 too: the device is the reason
    assert "needs an NVIDIA sm_90" in reason and "none was found (device cpu)" in reason
    assert trtllm.device_unavailable_reason("cpu") == reason


def test_explicit_selection_raises_with_reason():
    with pytest.raises(BackendUnavailableError, match="needs an NVIDIA sm_90"):
        select_backend(TRTLLM_ATTN, plan(), make_qkv())


@pytest.mark.parametrize("arch", ["sm_80", "sm_89", "sm_120", "sm_121"])
def test_gpus_without_kernels_refused(monkeypatch, flashinfer_ok, arch):
    on_arch(monkeypatch, arch)
    reason = trtllm.unavailable_reason(plan(), make_qkv())
    assert f"no TRT-LLM attention kernel for {arch}" in reason
    assert ("workstation Blackwell" in reason) == arch.startswith("sm_12")


@pytest.mark.parametrize("arch", ["sm_90", "sm_100", "sm_103"])
def test_supported_gpus_accept_dense_and_skip(monkeypatch, flashinfer_ok, arch):
    on_arch(monkeypatch, arch)
    assert trtllm.unavailable_reason(plan(), make_qkv()) is None
    assert trtllm.unavailable_reason(plan(skip_factor=5000.0), make_qkv(heads_q=32, heads_kv=8)) is None


@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
def test_causal_refused(monkeypatch, flashinfer_ok, arch):
    on_arch(monkeypatch, arch)
    assert "causal" in trtllm.unavailable_reason(plan(causal=True), make_qkv())


@pytest.mark.parametrize("head_dim", [64, 96, 192, 256])
def test_head_dim_other_than_128_refused(monkeypatch, flashinfer_ok, head_dim):
    on_arch(monkeypatch, "sm_90")
    reason = trtllm.unavailable_reason(plan(), make_qkv(head_dim=head_dim))
    assert f"head_dim is {head_dim}" in reason


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_dtypes_other_than_bf16_refused(monkeypatch, flashinfer_ok, dtype):
    on_arch(monkeypatch, "sm_100")
    assert "dtypes" in trtllm.unavailable_reason(plan(), make_qkv(dtype=dtype))


def test_empty_sequence_refused(monkeypatch, flashinfer_ok):
    on_arch(monkeypatch, "sm_100")
    assert "empty" in trtllm.unavailable_reason(plan(), make_qkv((256, 0), (256, 0)))


def test_queries_are_zero_padded_to_the_key_length_only_where_shorter():
    from diffusers_trtllm.kernels.flashinfer_fmha import pad_queries_to_keys

    qkv = make_qkv((300, 50, 128), (300, 80, 64))
    qkv.q.normal_()
    padded, lengths = pad_queries_to_keys(qkv.q, qkv.seqlens_q, qkv.seqlens_kv)
    assert lengths == (300, 80, 128)
    assert torch.equal(padded[:300], qkv.q[:300]) and torch.equal(padded[300:350], qkv.q[300:350])
    assert not padded[350:380].any() and torch.equal(padded[380:], qkv.q[350:])


@pytest.mark.parametrize("seqlens_q,seqlens_kv", [((4096,), (512,)), ((4096, 4096), (257, 257)),
                                                   ((19320,), (19920,)), ((256, 384), (256, 512))])
def test_hopper_accepts_unequal_query_and_key_lengths(monkeypatch, flashinfer_ok, seqlens_q, seqlens_kv):
    # Wan text (512) / Wan 2.1 I2V image (257) cross-attention proven on an H200; fewer queries than keys
    # (Cosmos 3's generation stream) runs with zero-padded queries
    on_arch(monkeypatch, "sm_90")
    assert trtllm.unavailable_reason(plan(), make_qkv(seqlens_q, seqlens_kv)) is None


def test_hopper_accepts_ragged_batch_of_self_attention(monkeypatch, flashinfer_ok):
    on_arch(monkeypatch, "sm_90")
    assert trtllm.unavailable_reason(plan(skip_factor=100.0), make_qkv((1000, 1531, 7))) is None


def test_blackwell_accepts_cross_attention(monkeypatch, flashinfer_ok):
    on_arch(monkeypatch, "sm_103")
    assert trtllm.unavailable_reason(plan(), make_qkv((4096,), (512,))) is None


def test_hopper_int8_sage_reason_comes_from_triton_kernel(monkeypatch, flashinfer_ok):
    on_arch(monkeypatch, "sm_90")
    fake = types.SimpleNamespace(triton_sage_unavailable_reason=lambda q, k, v, **kw: "k block 1 not built")
    monkeypatch.setattr(trtllm, "triton_sage", fake)
    assert trtllm.unavailable_reason(plan(quant=AttnQuantSpec(dtype_qk="int8")), make_qkv()) == "k block 1 not built"


def test_hopper_triton_sage_skips_per_its_own_tile_not_the_plans(monkeypatch, flashinfer_ok):
    on_arch(monkeypatch, "sm_90")
    seen = {}

    def triton_attention(q, k, v, *args, skip_tile, **kw):
        seen["tile"] = skip_tile
        return q, None, None
    monkeypatch.setattr(trtllm.triton_sage, "triton_sage_attention", triton_attention)
    reasons = []
    monkeypatch.setattr(trtllm.triton_sage, "triton_sage_unavailable_reason",
                        lambda q, k, v, skip_tile=None, **kw: reasons.append(skip_tile))
    int8_skip = plan(quant=AttnQuantSpec(dtype_qk="int8"), skip_factor=100.0, tile=(128, 128))
    assert trtllm.unavailable_reason(int8_skip, make_qkv()) is None and reasons == [(64, 128)]
    trtllm.run(make_qkv(), int8_skip)
    assert seen["tile"] == trtllm.TRITON_SKIP_TILE_SM90 == (64, 128)


def test_int8_sage_refused_on_sm103(monkeypatch, flashinfer_ok):
    on_arch(monkeypatch, "sm_103")
    reason = trtllm.unavailable_reason(plan(quant=AttnQuantSpec(dtype_qk="int8")), make_qkv())
    assert "int8" in reason and "sm_103" in reason
    assert trtllm.unavailable_reason(plan(quant=AttnQuantSpec(dtype_qk="fp8_e4m3")), make_qkv()) is None


@pytest.mark.parametrize("q_block,k_block,ok", [(1, 1, True), (1, 4, True), (1, 16, True), (4, 16, False),
                                                (16, 16, False), (4, 1, False)])
def test_sage_block_sizes_on_blackwell(monkeypatch, flashinfer_ok, q_block, k_block, ok):
    on_arch(monkeypatch, "sm_100")
    quant = AttnQuantSpec(dtype_qk="int8", q_block_size=q_block, k_block_size=k_block)
    reason = trtllm.unavailable_reason(plan(quant=quant), make_qkv())
    assert (reason is None) == ok
    if not ok:
        assert f"q={q_block}, k={k_block}" in reason


def test_sage_specs_with_kernels():
    assert [s.dtype_qk for s in trtllm.sage_specs_with_kernels("sm_100")] == ["int8", "fp8_e4m3"]
    assert [s.dtype_qk for s in trtllm.sage_specs_with_kernels("sm_103")] == ["fp8_e4m3"]
    assert [s.dtype_qk for s in trtllm.sage_specs_with_kernels("sm_90")] == ["int8", "fp8_e4m3"]
    assert trtllm.sage_specs_with_kernels("sm_80") == []


# --------------------------------------------------------------------------- FlashInfer presence and version


@pytest.fixture
def fresh_flashinfer_check():
    trtllm.flashinfer_unavailable_reason.cache_clear()
    yield
    trtllm.flashinfer_unavailable_reason.cache_clear()


@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
def test_flashinfer_missing_refused(monkeypatch, fresh_flashinfer_check, arch):
    on_arch(monkeypatch, arch)
    monkeypatch.setattr(trtllm, "flashinfer_version", lambda: None)
    reason = trtllm.unavailable_reason(plan(), make_qkv())
    assert "FlashInfer is not installed" in reason and "flashinfer-python" in reason


def test_flashinfer_too_old_refused(monkeypatch, fresh_flashinfer_check):
    on_arch(monkeypatch, "sm_100")
    monkeypatch.setattr(trtllm, "flashinfer_version", lambda: "0.6.16rc1")
    reason = trtllm.unavailable_reason(plan(quant=AttnQuantSpec(dtype_qk="fp8_e4m3")), make_qkv())
    assert "0.6.16rc1 is too old" in reason


def test_flashinfer_import_failure_refused(monkeypatch, fresh_flashinfer_check):
    on_arch(monkeypatch, "sm_90")
    monkeypatch.setattr(trtllm, "flashinfer_version", lambda: "0.7.2.post1")

    def broken():
        raise ImportError("libcuda.so.1: cannot open shared object file")

    monkeypatch.setattr(trtllm, "flashinfer_prefill", broken)
    assert "import flashinfer.prefill` failed" in trtllm.unavailable_reason(plan(), make_qkv())


def test_flashinfer_lacking_an_argument_refused(monkeypatch, fresh_flashinfer_check):
    on_arch(monkeypatch, "sm_90")
    monkeypatch.setattr(trtllm, "flashinfer_version", lambda: "0.6.18")

    def old_fmha_v2(qkv, input_layout, workspace_buffer, seq_lens, max_q_len, max_kv_len, bmm1_scale, bmm2_scale,
                    batch_size, cum_seq_lens_q, cum_seq_lens_kv, mask_mode="causal"):
        pass

    monkeypatch.setattr(trtllm, "flashinfer_prefill", lambda: types.SimpleNamespace(trtllm_fmha_v2_prefill=old_fmha_v2))
    reason = trtllm.unavailable_reason(plan(), make_qkv())
    assert "skip_softmax_threshold_scale_factor" in reason


def test_installed_flashinfer_has_every_function(fresh_flashinfer_check):
    pytest.importorskip("flashinfer")
    for function in trtllm.REQUIRED_PARAMETERS:
        assert trtllm.flashinfer_unavailable_reason(function) is None, function


# --------------------------------------------------------------------------------- errors while running


class _FailingPrefill:
    def __init__(self, exc):
        self.exc = exc

    def trtllm_ragged_attention_deepseek(self, **kwargs):
        raise self.exc


@pytest.fixture
def small_workspace(monkeypatch):
    monkeypatch.setattr(flashinfer_fmha, "WORKSPACE_BYTES", 1024)
    monkeypatch.setattr(flashinfer_fmha, "_workspaces", flashinfer_fmha.StreamWorkspaces(4))


def test_missing_cubins_explained(monkeypatch, small_workspace):
    on_arch(monkeypatch, "sm_100")
    failing = _FailingPrefill(RuntimeError("Failed to get checksums.txt"))
    monkeypatch.setattr(flashinfer_fmha, "flashinfer_prefill", lambda: failing)
    with pytest.raises(flashinfer_fmha.CubinUnavailableError) as info:
        trtllm.run(make_qkv(), plan())
    message = str(info.value)
    for needle in ("checksums.txt", "FLASHINFER_CUBIN_DIR", "FLASHINFER_NO_DOWNLOAD", "flashinfer-cubin"):
        assert needle in message
    assert isinstance(info.value, RuntimeError)


def test_other_kernel_errors_pass_through(monkeypatch, small_workspace):
    on_arch(monkeypatch, "sm_100")
    failing = _FailingPrefill(RuntimeError("Missing TRTLLM-GEN kernel ragged attention: numHeadsQPerKv=3"))
    monkeypatch.setattr(flashinfer_fmha, "flashinfer_prefill", lambda: failing)
    with pytest.raises(RuntimeError, match="Missing TRTLLM-GEN kernel") as info:
        trtllm.run(make_qkv(), plan())
    assert not isinstance(info.value, flashinfer_fmha.CubinUnavailableError)


def test_run_on_unsupported_gpu_raises(monkeypatch):
    on_arch(monkeypatch, "sm_120")
    with pytest.raises(BackendUnavailableError, match="sm_120"):
        trtllm.run(make_qkv(), plan())


def test_warmup_validates_before_touching_a_gpu():
    with pytest.raises(ValueError, match="float16"):
        trtllm.warmup(device="cpu", dtypes=(torch.float16,))
    with pytest.raises(RuntimeError, match="needs an NVIDIA sm_90.*none was found"):
        trtllm.warmup(device="cpu")


@pytest.mark.parametrize("exc", [AssertionError("Failed to get checksums.txt from https://edge.urm.nvidia.com/x"),
                                 RuntimeError("Artifact not found locally: fmha/x.cubin (looked at /c/x.cubin). "
                                              "FLASHINFER_NO_DOWNLOAD is set — refusing to download.")])
def test_cubin_download_failures_are_explained(monkeypatch, small_workspace, exc):
    on_arch(monkeypatch, "sm_100")
    monkeypatch.setattr(flashinfer_fmha, "flashinfer_prefill", lambda: _FailingPrefill(exc))
    with pytest.raises(flashinfer_fmha.CubinUnavailableError):
        trtllm.run(make_qkv(), plan())


@pytest.mark.parametrize("message", ["cubin launch failed: an illegal memory access was encountered",
                                     "could not download the weights: see the docs"])
def test_errors_that_merely_mention_cubins_or_downloads_pass_through(monkeypatch, small_workspace, message):
    on_arch(monkeypatch, "sm_100")
    monkeypatch.setattr(flashinfer_fmha, "flashinfer_prefill", lambda: _FailingPrefill(RuntimeError(message)))
    with pytest.raises(RuntimeError) as info:
        trtllm.run(make_qkv(), plan())
    assert not isinstance(info.value, flashinfer_fmha.CubinUnavailableError)


def on_streams(monkeypatch, *streams):
    order = iter(streams)
    monkeypatch.setattr(flashinfer_fmha, "_stream_id", lambda device: next(order))


def test_workspace_is_per_stream(monkeypatch, small_workspace):
    on_streams(monkeypatch, 1, 1, 2)
    first, again, other = (flashinfer_fmha.workspace("cpu") for _ in range(3))
    assert first is again and other is not first
    assert first.dtype == torch.uint8 and first.numel() == 1024 and not first.any()


def test_workspaces_are_bounded_per_device_least_recently_used_first(monkeypatch, small_workspace):
    kept = flashinfer_fmha.WORKSPACES_PER_DEVICE
    on_streams(monkeypatch, *range(kept), 0, kept, 0, 1, *range(kept))
    first = {stream: flashinfer_fmha.workspace("cpu") for stream in range(kept)}
    assert flashinfer_fmha.workspace("cpu") is first[0]  # stream 0 used again: stream 1 is now the oldest
    flashinfer_fmha.workspace("cpu")  # one stream more than kept: stream 1's buffer is released
    assert flashinfer_fmha.workspace("cpu") is first[0]
    assert flashinfer_fmha.workspace("cpu") is not first[1]  # stream 1 comes back to a new buffer
    assert flashinfer_fmha.release_workspaces("cpu") == kept


def test_workspaces_of_one_device_never_release_another_devices(monkeypatch, small_workspace):
    kept = flashinfer_fmha.WORKSPACES_PER_DEVICE
    on_streams(monkeypatch, 0, *range(1, kept + 3), 0)
    other = flashinfer_fmha.workspace("meta")
    for _ in range(kept + 2):
        flashinfer_fmha.workspace("cpu")
    assert flashinfer_fmha.workspace("meta") is other
    assert flashinfer_fmha.release_workspaces("meta") == 1 and flashinfer_fmha.release_workspaces() == kept


def test_released_workspaces_are_allocated_anew(monkeypatch, small_workspace):
    on_streams(monkeypatch, 1, 2, 1)
    first, second = flashinfer_fmha.workspace("cpu"), flashinfer_fmha.workspace("cpu")
    assert trtllm.release_workspaces() == 2 and trtllm.release_workspaces() == 0
    assert flashinfer_fmha.workspace("cpu") is not first


def test_workspace_cache_needs_room_for_one_stream():
    with pytest.raises(ValueError, match="per_device must be >= 1.*got 0"):
        flashinfer_fmha.StreamWorkspaces(0)


def test_reference_models_trtllm_gen_batch_wide_statistics(monkeypatch):
    """On Blackwell, FlashInfer's SAGE quantizer takes K's mean and V's scales over the whole packed batch; the
    reference does the same there and per sequence elsewhere (the Hopper kernels)."""
    from diffusers_trtllm.backends import run_backend
    from diffusers_trtllm.backends.reference import reference_attention
    from diffusers_trtllm.quant import SageSemantics, batch_statistics

    torch.manual_seed(0)
    lens = (200, 120)
    q = torch.randn(sum(lens), 2, 128)
    k = torch.randn(sum(lens), 2, 128) + torch.cat([torch.full((lens[0], 2, 128), 3.0), torch.zeros(lens[1], 2, 128)])
    v = torch.randn(sum(lens), 2, 128) * torch.cat([torch.full((lens[0], 2, 128), 4.0), torch.ones(lens[1], 2, 128)])
    qkv = VarlenQKV(q, k, v, lens, lens)
    quant_plan = KernelPlan("TORCH_REFERENCE", SCALE, quant=AttnQuantSpec("fp8_e4m3"))
    semantics = SageSemantics("fp8_e4m3", 1, 16)
    k_mean, v_scale = batch_statistics(k, v)
    batch = torch.cat([reference_attention(q[s], k[s], v[s], SCALE, quant=semantics, k_mean=k_mean,
                                           v_scale=v_scale)[0] for s in (slice(0, 200), slice(200, 320))])
    per_sequence = torch.cat([reference_attention(q[s], k[s], v[s], SCALE, quant=semantics)[0]
                              for s in (slice(0, 200), slice(200, 320))])
    monkeypatch.setattr(trtllm, "gpu_arch", lambda device: "sm_100")
    assert torch.equal(run_backend("TORCH_REFERENCE", qkv, quant_plan).out, batch)
    monkeypatch.setattr(trtllm, "gpu_arch", lambda device: None)
    assert torch.equal(run_backend("TORCH_REFERENCE", qkv, quant_plan).out, per_sequence)
    assert not torch.equal(batch, per_sequence)
