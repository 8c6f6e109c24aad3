"""No host read on the per-call attention path: what the GPU computes is never waited for by the host between
denoising steps (HunyuanVideo 1.5: exactly one read per transformer call, the text lengths). The transformer calls
run inside ``cache_context(...)`` as diffusers' pipelines make them; a call outside any pipeline reads its
timestep argument once (the run tracker's channel for bare transformers), which is counted apart.

Detection on a CPU (:class:`HostReads`). A host read is whatever brings tensor data into Python or onto the host:

- at the dispatcher (``TorchDispatchMode``): ``aten._local_scalar_dense`` (``item``, ``float``, ``int``, ``bool``,
  ``if tensor``), ``aten.is_nonzero``, ``aten.equal``, ``aten.nonzero`` (its output shape is data), and
  ``aten._to_copy`` / ``aten.copy_`` from another device to the CPU;
- above it (``TorchFunctionMode``): ``Tensor.tolist``, ``Tensor.cpu`` and ``Tensor.numpy``, which on a CPU
  tensor never reach the dispatcher, so only this layer sees them in a CPU test (they state the intent to bring
  data to the host; on a GPU they are the device-to-host copies above), and ``Tensor.to("cpu")`` from another
  device (``.to(x.device)``, diffusers' device-following idiom, copies nothing on the same device).

A read counts when Python's stack passes through ``diffusers_trtllm`` (diffusers' own transformer code has host
reads of its own, e.g. HunyuanVideo 1.5's ``if torch.all(image_embeds == 0)``; they are not this package's). When
the attention op (``torch.ops.diffusers_trtllm.attention``) reaches the dispatcher, its Python body is run with
both modes active, so the backend's code is watched too.

Exempt, by design: reads of host tensors. The op's ``settings`` (a float64 CPU tensor; the run's, filled once per
step, are on the CPU too) and ``valid_lengths`` (HunyuanVideo's int CPU tensor of text lengths) are host tensors
by the op's contract, so reading them never waits for a device; the op checks that contract here (both must be
on the CPU).
Everything else read on the path would be a device sync on a GPU.
"""

import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from diffusers_trtllm import AttentionConfig, enable_trtllm_attention
from diffusers_trtllm.backends.base import TRTLLM_ON_REFERENCE_ENV
from diffusers_trtllm.ops import attention, packed_problem
from diffusers_trtllm.plan import CallPlanner
from diffusers_trtllm.run_state import OWNER, open_run
from diffusers_trtllm.steps import RunTracker
from diffusers_trtllm.tiny_pipelines import tiny_hunyuan_video15_transformer

from helpers import cosmos3_transformer_call, pipeline_context, tiny_wan, wan_inputs
from test_hunyuan_video15 import transformer_inputs as hunyuan_inputs

PACKAGE_DIR = "/diffusers_trtllm/"
SYNCING_OPS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default,
               torch.ops.aten.equal.default, torch.ops.aten.nonzero.default}
COPY_OPS = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default}
READING_METHODS = {torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy}
ATTENTION_OP = torch.ops.diffusers_trtllm.attention.default
attention_implementation = attention._init_fn  # the op's Python body, below the dispatcher


def _storage(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.device)


class HostReads:
    """Records host reads made through ``diffusers_trtllm`` while active (see the module docstring)."""

    def __init__(self):
        self.reads: list[str] = []  # "what: where" of each counted read
        self._exempt: set[tuple] = set()
        self._dispatch = _DispatchWatch(self)
        self._function = _FunctionWatch(self)

    def __enter__(self):
        self._function.__enter__()
        self._dispatch.__enter__()
        return self

    def __exit__(self, *exc):
        self._dispatch.__exit__(*exc)
        self._function.__exit__(*exc)

    def record(self, what: str, tensor) -> None:
        if torch.is_tensor(tensor) and _storage(tensor) in self._exempt:
            return
        stack = traceback.extract_stack()
        ours = [f for f in stack if PACKAGE_DIR in f.filename]
        if ours:
            self.reads.append(f"{what}: {ours[-1].filename.split(PACKAGE_DIR)[-1]}:{ours[-1].lineno}")

    def run_op(self, args, kwargs):
        """Run the attention op's implementation with both watches active inside it, its host arguments exempt."""
        valid_lengths, settings = args[3], args[4]
        run = open_run(int(settings[OWNER]))
        host_args = [t for t in (valid_lengths, settings, run.settings if run else None) if t is not None]
        assert all(t.device.type == "cpu" for t in host_args), "the op's host tensors must live on the CPU"
        added = {_storage(t) for t in host_args} - self._exempt
        self._exempt |= added
        try:
            with self._function, self._dispatch:
                return attention_implementation(*args, **kwargs)
        finally:
            self._exempt -= added


class _DispatchWatch(TorchDispatchMode):
    def __init__(self, owner: HostReads):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is ATTENTION_OP:
            return self.owner.run_op(args, kwargs)
        if func in SYNCING_OPS:
            self.owner.record(str(func), args[0])
        elif func in COPY_OPS:
            source, target = _copy_ends(func, args, kwargs)
            if source.device.type != "cpu" and target == "cpu":
                self.owner.record(f"{func} to cpu", source)
        return func(*args, **kwargs)


def _copy_ends(func, args, kwargs) -> tuple[torch.Tensor, str]:
    """(source tensor, target device type) of a copy."""
    if func is torch.ops.aten.copy_.default:
        return args[1], args[0].device.type
    device = kwargs.get("device")
    return args[0], (torch.device(device).type if device is not None else args[0].device.type)


class _FunctionWatch(TorchFunctionMode):
    def __init__(self, owner: HostReads):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in READING_METHODS or (func is torch.Tensor.to and _to_host(args, kwargs)):
            self.owner.record(getattr(func, "__name__", str(func)), args[0])
        return func(*args, **kwargs)


def _to_host(args, kwargs) -> bool:
    """``tensor.to(...)`` from a device to the CPU (``.to(x.device)`` on a CPU tensor copies nothing)."""
    targets = list(args[1:]) + [kwargs.get("device")]
    return args[0].device.type != "cpu" and any(
        isinstance(t, (str, torch.device)) and torch.device(t).type == "cpu" for t in targets)


def test_the_detector_counts_package_reads_only_and_spares_exempt_tensors():
    lengths = torch.tensor([3, 2])
    q = torch.randn(2, 3, 1, 16)
    reads = HostReads()
    with reads:
        x = torch.arange(4.0)
        for read in (lambda: x.sum().item(), lambda: x.tolist(), lambda: x.cpu(), lambda: x.nonzero(),
                     lambda: bool(x[0]), lambda: torch.equal(x, x)):
            read()
        assert reads.reads == []  # made here, not by diffusers_trtllm
        packed_problem(q, q, q, lengths)  # Tensor.tolist, outside the op: counted
        RunTracker(CallPlanner(AttentionConfig()), 1000, gated=True).on_transformer_call(
            torch.tensor(500.0))  # float()
    assert [r.split(":")[0] for r in reads.reads] == ["tolist", "aten._local_scalar_dense.default"], reads.reads
    reads.reads.clear()
    reads._exempt.add(_storage(lengths))
    with reads:
        packed_problem(q, q, q, lengths)
    assert reads.reads == []


@pytest.fixture(scope="module")
def cosmos3_call():
    return cosmos3_transformer_call()


CONFIGS = {
    "sdpa": {"default": {"backend": "TORCH_SDPA"}},
    "trtllm-seam-skip-sage": {"default": {"backend": "TRTLLM_ATTN", "skip_softmax": {"threshold": 0.3},
                                          "quant": {"dtype_qk": "int8"}}},
}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("name", ["wan", "cosmos3"])
def test_no_host_read_on_the_attention_path(name, config, cosmos3_call, monkeypatch):
    monkeypatch.setenv(TRTLLM_ON_REFERENCE_ENV, "1")  # TRTLLM_ATTN computes with the reference on the CPU
    if name == "wan":
        model, inputs = tiny_wan(), wan_inputs(batch=1, frames=1, height=8, width=8)
        spec = CONFIGS[config]
    else:
        model, inputs = cosmos3_call
        # Cosmos 3's causal text stream needs a backend that runs causal attention (TRTLLM_ATTN does not)
        spec = dict(CONFIGS[config], per_role={"und_causal": {"backend": "TORCH_SDPA"}})
    with enable_trtllm_attention(model, spec) as handle, torch.no_grad():
        reads = HostReads()
        with reads, pipeline_context(model):
            model(**inputs)
        # a model without cache_context (Cosmos 3 under diffusers 0.40) is followed through its timestep argument
        expected = [] if hasattr(model, "cache_context") else ["steps.py"]
        assert [r.split(":")[1].strip() for r in reads.reads] == expected, reads.reads
        assert handle.stats.records  # the watched path ran and counted


def test_a_transformer_call_outside_a_pipeline_reads_its_timestep_once():
    model, inputs = tiny_wan(), wan_inputs(batch=1, frames=1, height=8, width=8)
    with enable_trtllm_attention(model, CONFIGS["sdpa"]), torch.no_grad():
        reads = HostReads()
        with reads:
            model(**inputs)
            model(**inputs)
    assert [r.split(":")[1].strip() for r in reads.reads] == ["steps.py"] * 2, reads.reads


@pytest.mark.parametrize("config", list(CONFIGS))
def test_hunyuan_reads_the_text_lengths_once_per_transformer_call(config, monkeypatch):
    monkeypatch.setenv(TRTLLM_ON_REFERENCE_ENV, "1")
    model = tiny_hunyuan_video15_transformer()
    inputs = hunyuan_inputs(frames=1, height=4, width=4)
    with enable_trtllm_attention(model, CONFIGS[config]), torch.no_grad():
        reads = HostReads()
        with reads:
            for name in ("pred_cond", "pred_uncond"):  # HunyuanVideo 1.5's pipeline publishes names only
                with model.cache_context(name):
                    model(**inputs)
    assert len(reads.reads) == 2 and all(r.startswith("cpu: processors/hunyuan_video15.py") for r in reads.reads), \
        reads.reads


@pytest.mark.gpu
@pytest.mark.parametrize("config", [{"default": {"backend": "auto"}}, CONFIGS["sdpa"]], ids=["auto", "sdpa"])
def test_no_device_sync_in_a_transformer_call_on_the_gpu(config):
    model = tiny_wan().to("cuda", torch.bfloat16)
    inputs = {k: v.to("cuda", torch.bfloat16 if v.is_floating_point() else v.dtype) if torch.is_tensor(v) else v
              for k, v in wan_inputs(batch=1, frames=1, height=8, width=8).items()}
    with enable_trtllm_attention(model, config), torch.no_grad():
        with pipeline_context(model, step=0):
            model(**inputs)  # first call: kernels load and per-shape choices are made
        torch.cuda.synchronize()
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with pipeline_context(model, step=1, sigma=0.4):
                model(**inputs)
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        torch.cuda.synchronize()
