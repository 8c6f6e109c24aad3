"""Pieces shared by ``examples/generate.py``, ``examples/evaluate.py`` and ``benchmarks/transformer_step.py``.

- :data:`MODELS`: the models of the test plan by id (pipeline class, test-plan shape, tiny builder, and the real
  transformer configuration for the random-weight speed run);
- loading and running a pipeline to video frames, timing its transformer calls (:class:`TransformerTimer`);
- the test plan's attention configurations (:func:`test_plan_configs`) and a SageAttention peer
  (:func:`sageattention_peer`), patched in through a temporarily replaced ``TORCH_SDPA`` backend;
- video metrics: PSNR, SSIM (here, in torch) and LPIPS (AlexNet, from the ``lpips`` package when it can load);
- reports: what ran per step and layer (:func:`describe_attention_plan`), Markdown tables, plots.

Heavy or optional imports (diffusers pipelines, matplotlib, lpips, sageattention) happen inside the functions
that need them: the speed benchmark runs on a GPU machine that has none of the plotting or metric packages.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping, Sequence

import torch

from .backends.base import KernelPlan, KernelResult, VarlenQKV, get_backend, register_backend
from .cli import SAGE_PRESET
from .config import TORCH_SDPA, AttentionConfig, AttnQuantSpec
from .install import pipeline_transformers

# ------------------------------------------------------------------------------------------------ model table


@dataclass(frozen=True)
class VideoShape:
    """Height and width in pixels, frame count, denoising steps; ``None`` leaves the pipeline's default."""

    height: int | None
    width: int | None
    frames: int | None
    steps: int | None = None


@dataclass(frozen=True)
class SpeedRun:
    """One denoising call of a transformer with random weights: its ``__init__`` arguments, the video it denoises,
    the VAE's (temporal, spatial) compression, its patch size, the conditioning token counts, the name of its
    block list, and a function building the call's keyword arguments."""

    transformer_config: Mapping
    shape: VideoShape
    vae_scale: tuple[int, int]
    patch: tuple[int, int, int]
    context_tokens: tuple[int, ...]
    blocks_attr: str
    inputs: Callable[["SpeedRun", torch.device, torch.dtype], dict]

    def latent_shape(self, channels: int) -> tuple[int, ...]:
        temporal, spatial = self.vae_scale
        return (1, channels, (self.shape.frames - 1) // temporal + 1, self.shape.height // spatial,
                self.shape.width // spatial)

    @property
    def video_tokens(self) -> int:
        """Video tokens the transformer sees: latent frames × rows × columns after patchifying."""
        frames, rows, cols = self.latent_shape(1)[2:]
        return (frames // self.patch[0]) * (rows // self.patch[1]) * (cols // self.patch[2])


def _wan_step_inputs(run: SpeedRun, device: torch.device, dtype: torch.dtype) -> dict:
    cfg = run.transformer_config
    (text_tokens,) = run.context_tokens
    return dict(hidden_states=torch.randn(run.latent_shape(cfg["in_channels"]), device=device, dtype=dtype),
                timestep=torch.tensor([500], device=device),
                encoder_hidden_states=torch.randn(1, text_tokens, cfg["text_dim"], device=device, dtype=dtype),
                return_dict=False)


def _hunyuan15_step_inputs(run: SpeedRun, device: torch.device, dtype: torch.dtype) -> dict:
    """Text-to-video: the MLLM and byT5 prompts fully valid (the most attention work), the SigLIP image tokens
    zero, which the transformer then masks out, as in the pipeline's t2v path."""
    cfg = run.transformer_config
    mllm_tokens, byt5_tokens, image_tokens = run.context_tokens
    ones = dict(device=device, dtype=torch.long)
    return dict(hidden_states=torch.randn(run.latent_shape(cfg["in_channels"]), device=device, dtype=dtype),
                timestep=torch.tensor([500.0], device=device, dtype=dtype),
                encoder_hidden_states=torch.randn(1, mllm_tokens, cfg["text_embed_dim"], device=device,
                                                  dtype=dtype),
                encoder_attention_mask=torch.ones(1, mllm_tokens, **ones),
                encoder_hidden_states_2=torch.randn(1, byt5_tokens, cfg["text_embed_2_dim"], device=device,
                                                    dtype=dtype),
                encoder_attention_mask_2=torch.ones(1, byt5_tokens, **ones),
                image_embeds=torch.zeros(1, image_tokens, cfg["image_embed_dim"], device=device, dtype=dtype),
                return_dict=False)


@dataclass(frozen=True)
class ModelEntry:
    """One model of the test plan.

    ``sdpa_roles``: roles or categories that stay dense on TORCH_SDPA in every TRT-LLM configuration (Wan's
    cross-attention: 512 text keys, a few percent of attention time, faster on cuDNN than on FMHAv2 and not
    proven on it for fewer queries than keys). ``frames_of`` takes the pipeline output (``output_type="np"``) to
    one video ``[frames, H, W, C]``.
    """

    name: str
    model_id: str
    aliases: tuple[str, ...]
    pipeline_class: str
    transformer_class: str
    shape: VideoShape
    fps: int
    tiny_builder: str
    tiny_shape: VideoShape
    frames_of: Callable
    sdpa_roles: tuple[str, ...] = ()
    speed: SpeedRun | None = None
    tiny_speed: SpeedRun | None = None


def _first_video(output):
    return output.frames[0]


def _cosmos_video(output):
    return output.video


_WAN_A14B_CONFIG = dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16,
                        out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40,
                        cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
# HunyuanVideo-1.5-Diffusers-720p_t2v: the class defaults (54 layers, 16 heads of 128) with the 720p target
# size and the t2v task, as diffusers' conversion script writes them.
_HUNYUAN15_720P_T2V_CONFIG = dict(in_channels=65, out_channels=32, num_attention_heads=16, attention_head_dim=128,
                                  num_layers=54, num_refiner_layers=2, mlp_ratio=4.0, patch_size=1, patch_size_t=1,
                                  qk_norm="rms_norm", text_embed_dim=3584, text_embed_2_dim=1472,
                                  image_embed_dim=1152, rope_theta=256.0, rope_axes_dim=(16, 56, 56),
                                  target_size=960, task_type="t2v")

# 9 frames at 128×128 make 192 video tokens for Wan and HunyuanVideo: two 128-key tiles, so skipping can happen.
TINY_SHAPE = VideoShape(128, 128, 9, 4)

MODELS: dict[str, ModelEntry] = {entry.model_id: entry for entry in (
    ModelEntry(
        name="Wan 2.2 A14B", model_id="Wan-AI/Wan2.2-T2V-A14B-Diffusers", aliases=("wan", "wan2.2"),
        pipeline_class="WanPipeline", transformer_class="WanTransformer3DModel",
        shape=VideoShape(720, 1280, 81, 50), fps=16,
        tiny_builder="tiny_wan22_pipeline", tiny_shape=TINY_SHAPE, frames_of=_first_video,
        sdpa_roles=("cross",),
        speed=SpeedRun(_WAN_A14B_CONFIG, VideoShape(720, 1280, 81), (4, 8), (1, 2, 2), (512,), "blocks",
                       _wan_step_inputs),
        tiny_speed=SpeedRun(dict(_WAN_A14B_CONFIG, num_attention_heads=2, attention_head_dim=16, text_dim=32,
                                 freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=64),
                            VideoShape(128, 128, 9), (4, 8), (1, 2, 2), (16,), "blocks", _wan_step_inputs)),
    ModelEntry(
        name="HunyuanVideo 1.5", model_id="hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-720p_t2v",
        aliases=("hunyuan", "hunyuanvideo1.5"), pipeline_class="HunyuanVideo15Pipeline",
        transformer_class="HunyuanVideo15Transformer3DModel", shape=VideoShape(720, 1280, 121, 50), fps=24,
        tiny_builder="tiny_hunyuan_video15_pipeline", tiny_shape=TINY_SHAPE, frames_of=_first_video,
        # 81 frames: 75,600 video + 1,985 context tokens (~77.6k), the shape DESIGN.md measured; 121 frames
        # (the pipeline's default) would make each step ~1.6× longer than the benchmark's time budget allows.
        speed=SpeedRun(_HUNYUAN15_720P_T2V_CONFIG, VideoShape(720, 1280, 81), (4, 16), (1, 1, 1),
                       (1000, 256, 729), "transformer_blocks", _hunyuan15_step_inputs),
        tiny_speed=SpeedRun(dict(_HUNYUAN15_720P_T2V_CONFIG, in_channels=9, out_channels=4, num_attention_heads=2,
                                 attention_head_dim=16, num_layers=2, num_refiner_layers=1, text_embed_dim=32,
                                 text_embed_2_dim=16, image_embed_dim=16, rope_axes_dim=(4, 6, 6)),
                            VideoShape(128, 128, 9), (4, 16), (1, 1, 1), (24, 8, 4), "transformer_blocks",
                            _hunyuan15_step_inputs)),
    ModelEntry(
        name="Cosmos 3 Super", model_id="nvidia/Cosmos3-Super", aliases=("cosmos", "cosmos3"),
        pipeline_class="Cosmos3OmniPipeline", transformer_class="Cosmos3OmniTransformer",
        shape=VideoShape(720, 1280, None, 35), fps=24,
        tiny_builder="tiny_cosmos3_pipeline", tiny_shape=TINY_SHAPE, frames_of=_cosmos_video,
        # its causal text stream needs a backend that runs causal attention (TRTLLM_ATTN does not)
        sdpa_roles=("und_causal",)),
)}


def find_model(name: str) -> ModelEntry:
    """The entry whose model id or alias is ``name`` (case-insensitive), or a ValueError listing them."""
    low = name.lower()
    for entry in MODELS.values():
        if low == entry.model_id.lower() or low in entry.aliases:
            return entry
    known = ", ".join(f"{e.model_id} ({'/'.join(e.aliases)})" for e in MODELS.values())
    raise ValueError(f"unknown model {name!r}; known: {known}")


def entry_for_pipeline(pipe) -> ModelEntry:
    """The entry whose pipeline class ``pipe`` is (for pipelines loaded from a local path)."""
    cls = type(pipe).__name__
    for entry in MODELS.values():
        if entry.pipeline_class == cls:
            return entry
    raise ValueError(f"{cls} is none of the evaluated pipelines {[e.pipeline_class for e in MODELS.values()]}")


def load_pipeline(entry: ModelEntry, *, tiny: bool, device: str, dtype: torch.dtype, source: str | None = None):
    """The tiny random pipeline of ``entry`` (from :mod:`diffusers_trtllm.tiny_pipelines`) or the pretrained one
    from ``source`` (default: its model id)."""
    if tiny:
        from . import tiny_pipelines

        builder = getattr(tiny_pipelines, entry.tiny_builder, None)
        if builder is None:
            raise ValueError(f"no tiny pipeline for {entry.name}: diffusers_trtllm.tiny_pipelines has no "
                             f"{entry.tiny_builder}()")
        return builder().to(device)
    import diffusers

    cls = getattr(diffusers, entry.pipeline_class)
    return cls.from_pretrained(source or entry.model_id, torch_dtype=dtype).to(device)


def generate_frames(pipe, entry: ModelEntry, prompt: str, shape: VideoShape, seed: int, *,
                    steps: int | None = None, output_type: str = "np"):
    """Run the pipeline; return ``[frames, C, H, W]`` float32 in [0, 1] on the CPU (``output_type="latent"``
    returns the raw output, for warm-up runs)."""
    kwargs = dict(height=shape.height, width=shape.width, num_frames=shape.frames,
                  num_inference_steps=steps if steps is not None else shape.steps)
    output = pipe(prompt, generator=torch.Generator().manual_seed(seed), output_type=output_type,
                  **{k: v for k, v in kwargs.items() if v is not None})
    if output_type == "latent":
        return output
    video = entry.frames_of(output)
    video = torch.as_tensor(video) if not torch.is_tensor(video) else video
    return video.float().permute(0, 3, 1, 2).contiguous().cpu()


def export_frames(frames: torch.Tensor, path: str, fps: int) -> str:
    """Write ``[frames, C, H, W]`` in [0, 1] to an MP4 with diffusers' ``export_to_video``."""
    from diffusers.utils import export_to_video

    return export_to_video(list(frames.permute(0, 2, 3, 1).clamp(0, 1).numpy()), path, fps=fps)


# ------------------------------------------------------------------------------------------------ timing


class TransformerTimer:
    """Times every forward call of the given transformers (a pipeline's ``transformer`` and ``transformer_2``)
    with forward hooks: CUDA events on a GPU (no synchronisation inside the denoising loop), wall clock on a CPU.
    Use as a context manager; :meth:`seconds` lists each call's duration."""

    def __init__(self, modules: Mapping[str, torch.nn.Module]):
        self.modules = dict(modules)
        self._marks: list[list] = []  # [on CUDA, start, end] per call
        self._hooks: list = []

    @classmethod
    def for_pipeline(cls, pipe) -> "TransformerTimer":
        return cls(pipeline_transformers(pipe))

    @staticmethod
    def _on_cuda(module: torch.nn.Module) -> bool:
        param = next(module.parameters(), None)
        return param is not None and param.is_cuda

    def _mark(self, cuda: bool):
        if cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def __enter__(self) -> "TransformerTimer":
        for module in self.modules.values():
            cuda = self._on_cuda(module)
            self._hooks.append(module.register_forward_pre_hook(
                lambda *_, cuda=cuda: self._marks.append([cuda, self._mark(cuda), None])))
            self._hooks.append(module.register_forward_hook(
                lambda *_, cuda=cuda: self._marks[-1].__setitem__(2, self._mark(cuda))))
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def seconds(self) -> list[float]:
        if any(cuda for cuda, _, _ in self._marks):
            torch.cuda.synchronize()
        return [start.elapsed_time(end) / 1e3 if cuda else end - start for cuda, start, end in self._marks]

    @property
    def total(self) -> float:
        return sum(self.seconds())


def synchronize(device: str | torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------------------------ configurations

REFERENCE_LABEL = "TORCH_SDPA dense (ref)"
SAGE_ATTN_LABEL = "SAGE_ATTN (SageAttention)"
PLAN_GATES = (1.00, 0.97, 0.94)

# Which test-plan table a configuration belongs to.
TABLE_SAGE, TABLE_SKIP, TABLE_SAGE_SKIP, TABLE_BACKENDS = "sage", "skip", "sage+skip", "backends"


@dataclass(frozen=True)
class EvalConfig:
    """One configuration of the test plan. ``peer`` names an attention implementation outside this package
    (``SAGE_ATTN``), patched in for the run; ``config`` is then TORCH_SDPA everywhere."""

    label: str
    table: str
    config: AttentionConfig
    gate: float | None = None
    peer: str | None = None


def skip_settings(threshold: float | None, target_sparsity: float | None) -> dict:
    """The Skip-Softmax amount: λ itself, or a point on a calibrated curve (needs a calibrated checkpoint)."""
    if (threshold is None) == (target_sparsity is None):
        raise ValueError("set exactly one of threshold (λ) and target_sparsity")
    return {"threshold": threshold} if threshold is not None else {"target_sparsity": target_sparsity}


def attention_config(backend: str, *, sdpa_roles: Sequence[str] = (), skip: Mapping | None = None,
                     quant: AttnQuantSpec | None = None) -> AttentionConfig:
    """``backend`` (with ``skip`` / ``quant``) for every attention call except ``sdpa_roles``, which run dense on
    TORCH_SDPA."""
    default = {"backend": backend, "skip_softmax": dict(skip) if skip else None,
               "quant": dataclasses.asdict(quant) if quant else None}
    return AttentionConfig.from_dict({"default": default,
                                      "per_role": {role: {"backend": TORCH_SDPA} for role in sdpa_roles}})


def test_plan_configs(backend: str, skip: Mapping, *, gates: Sequence[float] = PLAN_GATES,
                      sage: AttnQuantSpec = SAGE_PRESET, sdpa_roles: Sequence[str] = ()) -> list[EvalConfig]:
    """The test plan's configurations in run order; the first is the reference. ``backend`` runs every
    non-reference configuration (TRTLLM_ATTN on a GPU; TORCH_REFERENCE, same semantics, on a CPU)."""
    sage_name = {"fp8_e4m3": "FP8", "int8": "INT8"}[sage.dtype_qk] + "-SAGE"

    def make(**kw) -> AttentionConfig:
        return attention_config(backend, sdpa_roles=sdpa_roles, **kw)

    sdpa_only = AttentionConfig.from_dict({"default": {"backend": TORCH_SDPA}})
    configs = [EvalConfig(REFERENCE_LABEL, TABLE_BACKENDS, sdpa_only),
               EvalConfig("trtllm-gen BF16 dense", TABLE_SAGE, make()),
               EvalConfig(f"trtllm-gen {sage_name}", TABLE_SAGE, make(quant=sage))]
    for gate in gates:
        configs.append(EvalConfig(f"trtllm-gen Skip D={gate:.2f}", TABLE_SKIP,
                                  make(skip={**skip, "disabled_until_timestep": gate}), gate))
    for gate in gates:
        configs.append(EvalConfig(f"trtllm-gen {sage_name}+Skip D={gate:.2f}", TABLE_SAGE_SKIP,
                                  make(skip={**skip, "disabled_until_timestep": gate}, quant=sage), gate))
    configs.append(EvalConfig(SAGE_ATTN_LABEL, TABLE_BACKENDS, sdpa_only, peer="SAGE_ATTN"))
    return configs


@contextlib.contextmanager
def replaced_backend(name: str, runner: Callable[[VarlenQKV, KernelPlan], KernelResult],
                     check: Callable[[KernelPlan, VarlenQKV], str | None] = lambda plan, qkv: None) -> Iterator[None]:
    """Temporarily run backend ``name``'s calls through ``runner`` (a peer implementation, or none at all)."""
    original = get_backend(name)
    register_backend(name, runner, check, original.priority)
    try:
        yield
    finally:
        register_backend(original.name, original.runner, original.check, original.priority)


def sageattention_unavailable_reason(device: str | torch.device) -> str | None:
    """Why the SageAttention peer cannot run here, or None."""
    try:
        import sageattention  # noqa: F401
    except Exception as e:  # noqa: BLE001  (a broken install raises more than ImportError)
        return f"sageattention is not importable ({type(e).__name__}: {e}); pip install sageattention on a CUDA GPU"
    if torch.device(device).type != "cuda":
        return f"SageAttention runs on CUDA GPUs only; this run is on {device}"
    return None


def _sageattention_run(qkv: VarlenQKV, plan: KernelPlan) -> KernelResult:
    from sageattention import sageattn

    def one(q, k, v):  # [B, S, H, D]; SageAttention 1 takes equal head counts
        if k.shape[2] != q.shape[2]:
            k, v = (x.repeat_interleave(q.shape[2] // x.shape[2], dim=2) for x in (k, v))
        return sageattn(q, k, v, tensor_layout="NHD", is_causal=plan.causal, sm_scale=plan.scale)

    if qkv.uniform:
        b = qkv.batch_size
        out = one(*(x.view(b, -1, *x.shape[1:]) for x in (qkv.q, qkv.k, qkv.v)))
        return KernelResult(out.reshape(qkv.q.shape))
    out = torch.empty_like(qkv.q)
    for q, k, v, rows in qkv.sequences():
        out[rows] = one(q[None], k[None], v[None])[0]
    return KernelResult(out)


def sageattention_peer() -> contextlib.AbstractContextManager:
    """Run TORCH_SDPA's calls through SageAttention (PyPI ``sageattention``) while the context is open."""
    return replaced_backend(TORCH_SDPA, _sageattention_run)


def no_attention() -> contextlib.AbstractContextManager:
    """TORCH_SDPA's calls return Q unchanged: a step without attention work, to measure attention's share."""
    return replaced_backend(TORCH_SDPA, lambda qkv, plan: KernelResult(qkv.q))


# ------------------------------------------------------------------------------------------------ metrics


def psnr(video: torch.Tensor, reference: torch.Tensor) -> float:
    """Peak signal-to-noise ratio in dB of values in [0, 1]; inf for identical videos."""
    mse = torch.mean((video.double() - reference.double()) ** 2).item()
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def ssim(video: torch.Tensor, reference: torch.Tensor, window: int = 11, sigma: float = 1.5) -> float:
    """Mean structural similarity (Wang et al. 2004: Gaussian window 11, σ 1.5, K1 0.01, K2 0.03, range 1) over
    frames and channels of ``[frames, C, H, W]`` videos in [0, 1]. Frames smaller than the window use a window
    of their size."""
    x, y = video.float(), reference.float()
    window = min(window, x.shape[-1], x.shape[-2])
    coords = torch.arange(window, dtype=torch.float32) - (window - 1) / 2
    g = torch.exp(-coords ** 2 / (2 * sigma ** 2))
    g = g / g.sum()
    height, width = x.shape[-2:]

    def band(size: int) -> torch.Tensor:  # valid 1-D convolution with g as a [size - window + 1, size] matrix
        m = torch.zeros(size - window + 1, size)
        for i in range(size - window + 1):
            m[i, i:i + window] = g
        return m

    rows, cols = band(height), band(width).T

    def blur(t):  # the Gaussian is separable: two 1-D passes, as matrix products
        return rows @ t @ cols

    c1, c2 = 0.01 ** 2, 0.03 ** 2
    mx, my = blur(x), blur(y)
    vx, vy, cxy = blur(x * x) - mx ** 2, blur(y * y) - my ** 2, blur(x * y) - mx * my
    s = ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx ** 2 + my ** 2 + c1) * (vx + vy + c2))
    return s.double().mean().item()


class LpipsScorer:
    """LPIPS with AlexNet features (the ``lpips`` package). Its weights come from torchvision's download at first
    use; where that fails (offline, or torchvision unusable), :attr:`unavailable` says why and :meth:`score`
    returns None."""

    def __init__(self, device: str = "cpu", batch_frames: int = 8):
        self.device = device
        self.batch_frames = batch_frames
        self.unavailable: str | None = None
        self._model = None
        try:
            import lpips

            self._model = lpips.LPIPS(net="alex", verbose=False).to(device).eval()
        except Exception as e:  # noqa: BLE001  (import, download and load failures all mean: no LPIPS)
            self.unavailable = f"LPIPS (AlexNet) could not be loaded: {type(e).__name__}: {str(e).splitlines()[0]}"

    @torch.no_grad()
    def score(self, video: torch.Tensor, reference: torch.Tensor) -> float | None:
        """Mean per-frame LPIPS of ``[frames, C, H, W]`` videos in [0, 1]."""
        if self._model is None:
            return None
        total = 0.0
        for i in range(0, video.shape[0], self.batch_frames):
            a, b = (t[i:i + self.batch_frames].to(self.device) * 2 - 1 for t in (video, reference))
            total += self._model(a, b).sum().item()
        return total / video.shape[0]


# ------------------------------------------------------------------------------------------------ what ran


def _layer_step_records(stats) -> dict[tuple[int, str], list]:
    """``(step, layer) -> [CallRecord, ...]`` (a layer may run more than one way in a step)."""
    grouped: dict[tuple[int, str], list] = {}
    for key, rec in stats.records.items():
        grouped.setdefault((key[0], key[1]), []).append(rec)
    return grouped


def sparsity_grid(stats) -> dict[tuple[int, str], float | None]:
    """Achieved sparsity per ``(step, layer)``; None where the backend did not count."""
    grid = {}
    for key, recs in _layer_step_records(stats).items():
        if any(not r.counted for r in recs):
            grid[key] = None
            continue
        total = sum(int(r.total) for r in recs)
        grid[key] = sum(int(r.skipped) for r in recs) / total if total else 0.0
    return grid


def compress_layer_names(names: Sequence[str]) -> list[str]:
    """``transformer.blocks.0.attn1 … transformer.blocks.39.attn1`` -> ``transformer.blocks.[0-39].attn1``."""
    groups: dict[str, list[int]] = {}
    plain = []
    for name in names:
        match = re.search(r"\.(\d+)(?=\.|$)", name)
        if match is None:
            plain.append(name)
            continue
        pattern = name[:match.start(1)] + "{}" + name[match.end(1):]
        groups.setdefault(pattern, []).append(int(match.group(1)))
    out = []
    for pattern, indices in groups.items():
        indices = sorted(set(indices))
        runs, start = [], indices[0]
        for prev, cur in zip(indices, indices[1:] + [None]):
            if cur != prev + 1:
                runs.append(f"{start}" if start == prev else f"{start}-{prev}")
                start = cur
        text = runs[0] if len(runs) == 1 and "-" not in runs[0] else f"[{','.join(runs)}]"
        out.append(pattern.format(text))
    return sorted(plain + out)


def _step_ranges(steps: Sequence[int]) -> str:
    return f"{steps[0]}" if len(steps) == 1 else f"{steps[0]}-{steps[-1]}"


def describe_attention_plan(stats) -> str:
    """Markdown table of what ran: consecutive steps with the same per-layer modes share a row per mode, with the
    layers (compressed) and the steps' achieved sparsity where counted."""
    per_step: dict[int, dict[str, list[str]]] = {}
    for (step, layer), recs in sorted(_layer_step_records(stats).items()):
        mode = " & ".join(sorted(f"{r.backend}:{r.mode}" for r in recs))
        per_step.setdefault(step, {}).setdefault(mode, []).append(layer)
    sparsity = stats.per_step()
    lines = ["| steps | ran | layers | sparsity per step |", "|---|---|---|---|"]
    steps = sorted(per_step)
    i = 0
    while i < len(steps):
        j = i
        while j + 1 < len(steps) and per_step[steps[j + 1]] == per_step[steps[i]]:
            j += 1
        group = steps[i:j + 1]
        measured = " ".join(format_number(sparsity.get(s), 3) for s in group)
        for mode, layers in sorted(per_step[steps[i]].items()):
            lines.append(f"| {_step_ranges(group)} | {mode} | {', '.join(compress_layer_names(layers))} | "
                         f"{measured} |")
        i = j + 1
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ reports


def format_number(value, digits: int, suffix: str = "") -> str:
    """Fixed-point text for tables: ``n/a`` for None, ``inf`` for infinity."""
    if value is None:
        return "n/a"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return f"{value:.{digits}f}{suffix}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]], align: str | None = None) -> str:
    """A Markdown table; ``align`` has one character per column, ``l`` or ``r`` (default: all left)."""
    align = align or "l" * len(headers)
    rule = ["---:" if a == "r" else "---" for a in align]
    escape = lambda cell: str(cell).replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(rule) + " |"]
    lines += ["| " + " | ".join(escape(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def plot_quality_vs_speedup(points: Sequence[tuple[str, float, float]], ylabel: str, path: str,
                            title: str = "") -> str:
    """Scatter of ``(label, speed-up, quality)`` points, each labelled, to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, speedup, quality in points:
        ax.scatter(speedup, quality)
        ax.annotate(label, (speedup, quality), fontsize=7, xytext=(4, 3), textcoords="offset points")
    ax.axvline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("transformer speed-up vs reference (×)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_sparsity(grids: Mapping[str, Mapping[tuple[int, str], float | None]], path: str, title: str = "") -> str:
    """Per configuration: achieved sparsity per step (top row) and per step × layer as a heatmap; layers and steps
    without counts are blank. ``grids`` maps a configuration label to :func:`sparsity_grid`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    labels = list(grids)
    fig, axes = plt.subplots(2, len(labels), figsize=(4.2 * len(labels), 7), squeeze=False)
    for col, label in enumerate(labels):
        grid = grids[label]
        steps = sorted({s for s, _ in grid})
        layers = sorted({layer for _, layer in grid}, key=_natural_key)
        matrix = np.full((len(layers), len(steps)), np.nan)
        for (step, layer), value in grid.items():
            if value is not None:
                matrix[layers.index(layer), steps.index(step)] = value
        with warnings.catch_warnings():  # a step with no counted layer has no mean: left blank
            warnings.simplefilter("ignore", RuntimeWarning)
            step_mean = np.nanmean(matrix, axis=0)
        axes[0, col].plot(steps, step_mean, marker="o")
        axes[0, col].set_ylim(-0.02, 1.02)
        axes[0, col].set_title(label, fontsize=8)
        axes[0, col].set_xlabel("step")
        axes[0, col].set_ylabel("mean sparsity over layers")
        image = axes[1, col].imshow(matrix, aspect="auto", vmin=0, vmax=1, cmap="viridis", interpolation="nearest")
        axes[1, col].set_yticks(range(len(layers)), [_short_layer(name) for name in layers], fontsize=5)
        axes[1, col].set_xlabel("step")
        fig.colorbar(image, ax=axes[1, col], fraction=0.046)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _natural_key(name: str):
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _short_layer(name: str) -> str:
    return name.replace("transformer_blocks.", "").replace("blocks.", "")


@dataclass
class RunRecord:
    """One generation's numbers (used by the examples for tables and JSON)."""

    label: str
    table: str = TABLE_BACKENDS
    gate: float | None = None
    ran_on: str = ""
    run_s: float | None = None
    transformer_s: float | None = None
    transformer_calls: int = 0
    sparsity: float | None = None
    per_step: dict = field(default_factory=dict)
    lpips: float | None = None
    psnr: float | None = None
    ssim: float | None = None
    speedup_transformer: float | None = None
    speedup_run: float | None = None
    note: str = ""

    def to_json(self) -> dict:
        data = dataclasses.asdict(self)
        data["per_step"] = {str(k): v for k, v in self.per_step.items()}
        for key in ("psnr",):  # JSON has no infinity
            if data[key] is not None and math.isinf(data[key]):
                data[key] = "inf"
        return data

    def cells(self, model: str) -> list[str]:
        """This record as a row of :data:`RESULT_COLUMNS`."""
        return [model, self.label, self.ran_on or "n/a", format_number(self.gate, 2),
                format_number(self.lpips, 4), format_number(self.psnr, 2), format_number(self.ssim, 4),
                format_number(self.speedup_transformer, 3, "×"), format_number(self.speedup_run, 3, "×"),
                format_number(self.transformer_s, 3), format_number(self.run_s, 3),
                format_number(self.sparsity, 3), self.note]


RESULT_COLUMNS = ("Model", "config", "ran on", "D", "LPIPS ↓", "PSNR (dB) ↑", "SSIM ↑", "speed-up (transformer)",
                  "speed-up (run)", "transformer (s)", "run (s)", "sparsity", "notes")
RESULT_ALIGN = "lllrrrrrrrrrl"

# The test plan's tables: title, the configurations' tables shown in it, whether the reference row leads it.
PLAN_TABLES = (
    ("Step 1 — SAGE", (TABLE_SAGE,), True),
    ("Step 2 — Skip-Softmax (sweep of D = disabled_until_timestep)", (TABLE_SKIP,), False),
    ("Step 3 — SAGE + Skip (sweep of D)", (TABLE_SAGE_SKIP,), False),
    ("Step 4 — cross-backend comparison (every configuration)", (TABLE_SAGE, TABLE_SKIP, TABLE_SAGE_SKIP,
                                                                 TABLE_BACKENDS), True),
)


def plan_tables(model: str, records: Sequence[RunRecord]) -> str:
    """The test plan's four tables in Markdown, from ``records`` (the first is the reference)."""
    reference, rest = records[0], records[1:]
    sections = []
    for title, tables, with_reference in PLAN_TABLES:
        rows = ([reference] if with_reference else []) + [r for r in rest if r.table in tables]
        sections.append(f"## {title}\n\n" + markdown_table(RESULT_COLUMNS, [r.cells(model) for r in rows],
                                                           RESULT_ALIGN))
    return "\n\n".join(sections)
