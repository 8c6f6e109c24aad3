"""The attention op's rules at their edges, through ``torch.ops.diffusers_trtllm.*``: valid prefixes (forward and
gradient), the settings tensor and the skip value (FlashInfer's factor, or λ per key length), the probe's sums, the
gradient's scale, causality and grouped heads, and how an unplanned call chooses its backend (once per kind of
call, refusing or warning by its reason, in a bounded cache).

References are float64 (an explicit softmax over masked scores); the op runs TORCH_REFERENCE in float64 there, so
agreement is to float64 rounding.
"""

import warnings

import pytest
import torch

from diffusers_trtllm import errors, ops, run_state
from diffusers_trtllm.backends.base import TRTLLM_ON_REFERENCE_ENV
from diffusers_trtllm.backends.reference import reference_attention
from diffusers_trtllm.config import AttnQuantSpec
from diffusers_trtllm.errors import BackendUnavailableError

from helpers import counted_op as counted
from test_semantics_edges import positional_qkv

ATTENTION = torch.ops.diffusers_trtllm.attention
TIGHT = dict(rtol=1e-10, atol=1e-10)


def exact_attention(q, k, v, scale, causal=False, valid_lengths=None):
    """float64 attention of ``[B, S, H, D]`` tensors: GQA by repeating each key head over its query heads, causal
    bottom-right, sample ``b`` among its first ``valid_lengths[b]`` tokens; a query that sees no key gets 0."""
    q, k, v = (x.double() for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = (x.repeat_interleave(group, dim=2) for x in (k, v))
    sq, skv = q.shape[1], k.shape[1]
    visible = torch.ones(1, 1, sq, skv, dtype=torch.bool)
    if causal:
        visible = visible & torch.ones(sq, skv, dtype=torch.bool).tril(skv - sq)
    if valid_lengths is not None:
        valid = torch.arange(sq)[None, :] < valid_lengths[:, None]
        visible = visible & valid[:, None, :, None] & valid[:, None, None, :]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


def op_args(q, k, v, valid_lengths=None, *, skip=0.0, backend="TORCH_REFERENCE", scale=0.3, causal=False,
            quant="", per_kv_len=False, planned=True, tile=(128, 128)):
    """The op's arguments in its order."""
    return (q, k, v, valid_lengths, run_state.initial_settings(skip), backend, scale, causal, quant, per_kv_len,
            *tile, planned)



def qkv(batch=2, sq=5, skv=5, hq=2, hkv=2, dim=8, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, s, h, dim, generator=g, dtype=dtype)
                 for s, h in ((sq, hq), (skv, hkv), (skv, hkv)))


# --- valid prefixes -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("lengths", [[3, 5], [3, 4], [5, 5]], ids=["one_padded", "all_padded", "none_padded"])
@pytest.mark.parametrize("backend", ["TORCH_REFERENCE", "TORCH_SDPA"])
def test_valid_lengths_confine_each_sample_to_its_prefix_and_zero_its_padding(backend, lengths):
    """Samples of 5 tokens keeping their first ``lengths``: rows past a prefix are 0, and no token attends to a
    padding key."""
    q, k, v = qkv()
    lengths = torch.tensor(lengths)
    out = ATTENTION(*op_args(q, k, v, lengths, backend=backend))
    torch.testing.assert_close(out, exact_attention(q, k, v, 0.3, valid_lengths=lengths), **TIGHT)
    for sample, n in enumerate(lengths.tolist()):
        assert torch.equal(out[sample, n:], torch.zeros_like(out[sample, n:]))


def test_a_calls_settings_start_dense_with_sage_on_and_not_probed_in_float64():
    """The settings tensor's contract (module docstring): float64 on the host, so a skip factor keeps its digits;
    no run key until a handle plans the call."""
    settings = run_state.initial_settings()
    assert settings.dtype == torch.float64 and settings.device.type == "cpu"
    assert settings[[run_state.SKIP, run_state.SAGE, run_state.PROBE, run_state.OWNER]].tolist() == [0, 1, 0, 0]
    assert run_state.initial_settings(2822.62 * 0.1)[run_state.SKIP].item() == 2822.62 * 0.1


# --- the skip value: FlashInfer's factor, or λ per key length ---------------------------------------------------

@pytest.mark.parametrize("per_kv_len", [False, True])
def test_the_skip_value_is_the_factor_unless_it_is_lambda_per_key_length(per_kv_len):
    """128 queries on 384 keys: settings[SKIP] is FlashInfer's factor (λ = factor / 384), or with ``per_kv_len``
    λ itself (factor = λ · 384); both give λ = 2^-6 here (λ · 384 or λ / 384 would skip another number of tiles)."""
    lam, skv, scale = 2.0 ** -6, 384, 32 ** -0.5
    torch.manual_seed(0)
    q, k = positional_qkv(torch.linspace(0, skv - 1, 128)), positional_qkv(torch.arange(skv))
    v = torch.randn(skv, 2, 32)
    value = lam if per_kv_len else lam * skv
    out, counts, _ = counted(*op_args(q[None], k[None], v[None], skip=value, scale=scale, per_kv_len=per_kv_len,
                                      tile=(64, 64)))
    expected, skipped, total = reference_attention(q, k, v, scale, skip_lambda=lam, tile=(64, 64))
    assert 0 < skipped < total
    assert torch.equal(out[0], expected) and counts == [int(skipped), total, 1, 1]


# --- the accuracy probe's sums: float64 on q's device, as the fake says --------------------------------------

@pytest.mark.parametrize("rows", [0, 3])
def test_the_probes_sums_are_float64_and_added_only_at_a_probed_step(rows):
    """The run's probe sums are float64 ``[2]`` per site; the op adds to them at a step with probe rows only."""
    q, k, v = qkv(dtype=torch.float32)
    args = list(op_args(q, k, v, skip=0.0))
    args[4][run_state.PROBE] = rows
    errors = counted(*args)[2]
    assert errors.dtype == torch.float64 and errors.shape == (2,)
    assert (errors[1] > 0).item() == (rows > 0) and (errors[0] >= 0).item()


# --- the gradient: dense attention's, with the forward's scale, causality, heads and prefixes --------------------

def gradients(fn, q, k, v):
    """Gradients of a fixed random projection of ``fn(q, k, v)`` with respect to q, k, v."""
    inputs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = fn(*inputs)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    return torch.autograd.grad((out * weights).sum(), inputs)


@pytest.mark.parametrize("in_run", [False, True], ids=["outside-a-run", "counted-run"])
@pytest.mark.parametrize("causal", [False, True])
def test_gradient_is_dense_attentions_with_the_calls_scale_and_causality(in_run, causal):
    """4 queries on 7 keys: a causal query sees the keys up to its own position from the end (bottom-right)."""
    q, k, v = qkv(sq=4, skv=7)

    def through_op(q, k, v):
        args = op_args(q, k, v, causal=causal)
        return counted(*args)[0] if in_run else ATTENTION(*args)

    for got, expected in zip(gradients(through_op, q, k, v),
                             gradients(lambda *x: exact_attention(*x, 0.3, causal=causal), q, k, v)):
        torch.testing.assert_close(got, expected, **TIGHT)


@pytest.mark.parametrize("hq, hkv, dim", [(4, 2, 4), (6, 3, 3)])
def test_gradient_among_valid_prefixes_with_grouped_heads(hq, hkv, dim):
    """Grouped heads (head_dim equal to either head count) and a sample 2 tokens short of its 5: padding rows get
    no gradient and give none."""
    q, k, v = qkv(hq=hq, hkv=hkv, dim=dim)
    lengths = torch.tensor([5, 3])
    got = gradients(lambda *x: ATTENTION(*op_args(*x, lengths)), q, k, v)
    expected = gradients(lambda *x: exact_attention(*x, 0.3, valid_lengths=lengths), q, k, v)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, **TIGHT)
    assert all(torch.equal(g[1, 3:], torch.zeros_like(g[1, 3:])) for g in got)


# --- an unplanned call's backend: chosen once per kind of call ------------------------------------------------

@pytest.fixture
def fresh_choices(monkeypatch):
    """An empty choice cache and warning memory, as in a new process."""
    monkeypatch.setattr(ops, "_UNPLANNED_CHOICES", {})
    monkeypatch.setattr(errors, "_SAID", set())
    monkeypatch.delenv(TRTLLM_ON_REFERENCE_ENV, raising=False)


def unplanned(backend, *, skip=0.0, quant="", causal=False, dim=8, hq=2, hkv=2, sq=5, skv=5):
    q, k, v = qkv(batch=1, sq=sq, skv=skv, hq=hq, hkv=hkv, dim=dim, dtype=torch.float32)
    return ATTENTION(*op_args(q, k, v, backend=backend, skip=skip, quant=quant, causal=causal, planned=False))


SAGE_INT8 = ops.encode_quant(AttnQuantSpec(dtype_qk="int8"))


@pytest.mark.parametrize("feature", [dict(skip=0.1), dict(quant=SAGE_INT8)], ids=["skip", "sage"])
def test_an_explicit_dense_backend_refuses_a_feature_after_running_the_same_shape_dense(fresh_choices, feature):
    unplanned("TORCH_SDPA")
    with pytest.raises(BackendUnavailableError, match="backend TORCH_SDPA cannot run this attention: TORCH_SDPA "
                                                      r"runs dense attention only \(no Skip-Softmax, no SAGE\)"):
        unplanned("TORCH_SDPA", **feature)


def test_an_explicit_backend_is_checked_against_the_calls_causality(fresh_choices, monkeypatch):
    """Under the test seam TRTLLM_ATTN runs on any device but stays non-causal: the causal call of a shape it ran
    is refused."""
    monkeypatch.setenv(TRTLLM_ON_REFERENCE_ENV, "1")
    unplanned("TRTLLM_ATTN")
    with pytest.raises(BackendUnavailableError, match="TRTLLM_ATTN runs non-causal attention only"):
        unplanned("TRTLLM_ATTN", causal=True)


def test_an_explicit_gpu_backend_on_the_cpu_says_it_needs_the_gpu(fresh_choices):
    with pytest.raises(BackendUnavailableError, match=r"backend TRTLLM_ATTN cannot run this attention: TRTLLM_ATTN "
                                                      r"needs an NVIDIA sm_90 .* \(device cpu\)"):
        unplanned("TRTLLM_ATTN")


def test_auto_warns_once_per_dropped_feature_not_once_per_shape(fresh_choices):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        unplanned("auto")  # dense: nothing dropped, nothing said
        assert caught == []
        unplanned("auto", skip=0.1)
        unplanned("auto", skip=0.1, dim=16)  # another shape, the same reason
        unplanned("auto", quant=SAGE_INT8)  # another reason
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2, messages
    assert messages[0].startswith("diffusers_trtllm: auto runs attention dense on cpu: Skip-Softmax dropped (")
    assert messages[1].startswith("diffusers_trtllm: auto runs attention dense on cpu: SAGE int8 dropped (")
    assert "TORCH_SDPA: TORCH_SDPA runs dense attention only" in messages[0]



def test_a_kind_of_call_is_chosen_again_where_its_lengths_change_what_a_backend_checks(fresh_choices, monkeypatch):
    """TRTLLM_ATTN's checks read an empty sequence and, for SAGE, more queries than keys: a call of the same kind
    with such lengths is checked again, not handed the choice made for other lengths."""
    asked = []
    real = ops.select_backend
    monkeypatch.setattr(ops, "select_backend", lambda *args: asked.append(args[2]) or real(*args))
    q, k, v = (x.flatten(0, 1) for x in qkv(batch=1, sq=6, skv=6))

    def choose(seqlens_q, seqlens_kv):
        packed = ops.VarlenQKV(q[:sum(seqlens_q)], k[:sum(seqlens_kv)], v[:sum(seqlens_kv)], seqlens_q, seqlens_kv)
        return ops.unplanned_backend("auto", packed, False, 0.0, "")

    choose((3, 3), (3, 3))
    choose((2, 3), (3, 3))  # same kind: no new choice
    choose((4, 2), (3, 3))  # more queries than keys in one sequence
    choose((0, 3), (3, 3))  # an empty sequence
    choose((0, 3), (3, 3))
    assert [(a.seqlens_q, a.seqlens_kv) for a in asked] == [((3, 3), (3, 3)), ((4, 2), (3, 3)), ((0, 3), (3, 3))]


CACHE_SIZE = 256


@pytest.mark.parametrize("others, chosen_again", [(CACHE_SIZE - 1, False), (CACHE_SIZE, True)])
def test_the_choice_cache_forgets_the_oldest_kind_after_256_others(fresh_choices, monkeypatch, others,
                                                                   chosen_again):
    """A choice is made at a kind's first call and kept (the seam's variable is not read again); after 256 other
    kinds the oldest is chosen afresh, here without the seam: refused on the CPU."""
    monkeypatch.setenv(TRTLLM_ON_REFERENCE_ENV, "1")
    unplanned("TRTLLM_ATTN")
    monkeypatch.delenv(TRTLLM_ON_REFERENCE_ENV)
    unplanned("TRTLLM_ATTN")  # the kept choice
    for dim in range(1, others + 1):
        unplanned("TORCH_SDPA", dim=dim, hq=1, hkv=1, sq=1, skv=1)
    if chosen_again:
        with pytest.raises(BackendUnavailableError, match="needs an NVIDIA sm_90"):
            unplanned("TRTLLM_ATTN")
    else:
        unplanned("TRTLLM_ATTN")
