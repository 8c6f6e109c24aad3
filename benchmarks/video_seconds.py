"""Seconds per video: a whole text-to-video pipeline call, per attention configuration, phases apart.

Models, built with random weights directly on the GPU (nothing is downloaded):

- Wan 2.2 A14B T2V: both ``WanTransformer3DModel`` experts at A14B size (``transformer_step``'s builder), a
  UMT5-XXL encoder, the Wan VAE (float32, as diffusers' Wan example loads it), UniPC with flow shift 3 and the
  experts switching at t = 0.875, CFG on both experts (guidance 4 / 3);
- HunyuanVideo 1.5 720p t2v: its transformer, the Qwen2.5-VL-7B text model, the ByT5 glyph encoder (it only runs
  for quoted text, which the default prompt has none of), its VAE with tiling on (as diffusers' example decodes
  720p), flow-matching Euler, CFG through the pipeline's guider.

Text encoders have the real architecture and size; their tokenizers are character-level ones built in code
(``diffusers_trtllm.tiny_pipelines``: the real vocabularies need downloads, ByT5's excepted) padded to the lengths
the pipelines pad to (512 UMT5 tokens; 1,108 Qwen tokens, of which the pipeline crops the first 108), so the
encoders do the real amount of work. The token ids differ from a real tokenizer's, which random weights do not
notice; the prompt's valid tokens (the part HunyuanVideo's joint attention sees unpadded) are characters.

Configurations: diffusers' default processors (``diffusers``), diffusers' attention backends set with
``set_attention_backend`` (``diffusers:NAME``; ``backends`` tries every backend diffusers offers, this package's
``"trtllm"`` excepted, and those that refuse the model's attention on this machine become rows saying why: each
is first run once at a small size with the model's mask), and this package installed with
``enable_trtllm_attention`` (``dense``, ``sage``: SAGE fp8, ``sage_skip``: SAGE fp8 + Skip-Softmax at λ =
``--threshold``, no timestep gate). Every transformer is compiled with
``compile_repeated_blocks(fullgraph=True)`` after the attention is set up, and dynamo is reset between rows.

Each row: a warm-up call (two steps, each transformer cut to its first block: compiles the one block graph and
builds every kernel of both experts at a fraction of a call's cost; reported, not counted), then one timed call
with ``--steps`` denoising steps. Phases: text encoding (call start to the end of the last ``encode_prompt``),
denoising (to the start of ``vae.decode``), VAE decode (to the end of the call, frames included). Denoising is
scaled to ``--scale-to`` steps (40 for Wan, 50 for HunyuanVideo 1.5: the pipelines' step counts); every step costs
the same (no timestep gate here). The VAE and text encoders do not depend on the attention configuration: the
first row whose timed call succeeds decodes to frames, later rows stop at latents and carry its decode time (marked
*).

Random weights give near-uniform attention: Skip-Softmax skips few tiles here, so the skip row shows its cost at
this data, not a trained model's speed-up.

    PYTHONPATH=. python benchmarks/video_seconds.py --model wan --steps 2                 # H200; JSON to $OUT
    PYTHONPATH=. python benchmarks/video_seconds.py --model hunyuan --steps 1 --configs diffusers backends sage
    PYTHONPATH=. python benchmarks/video_seconds.py --tiny --model wan --compile eager     # CPU, seconds
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import diffusers
import torch
import transformers
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))  # transformer_step, when imported as a module by tests
from transformer_step import build_transformer, first_block_only, free, trtllm_warmup  # noqa: E402

from diffusers_trtllm import enable_trtllm_attention  # noqa: E402
from diffusers_trtllm.config import TORCH_REFERENCE, TRTLLM_ATTN, AttentionConfig, AttnQuantSpec  # noqa: E402
from diffusers_trtllm.dispatch import BACKEND_NAME as TRTLLM_DISPATCH_BACKEND  # noqa: E402
from diffusers_trtllm.install import pipeline_transformers  # noqa: E402
from evaluation import (TINY_SHAPE, ModelEntry, TransformerTimer, VideoShape, attention_config,  # noqa: E402
                        find_model, format_number, markdown_table, synchronize)
from evaluation.cli import ArgumentParser, check_backends, positive_int, user_errors  # noqa: E402

PROMPT = ("A red fox trots across a snowy meadow at sunrise, its breath visible in the cold air, while the camera "
          "tracks low beside it and pine trees drift past in soft focus.")
WARMUP_STEPS = 2  # with A14B's boundary at t = 0.875 the second of two steps runs the low-noise expert
DIFFUSERS_DEFAULT = "diffusers"
BACKENDS_GROUP = "backends"
PACKAGE_CONFIGS = ("dense", "sage", "sage_skip")
DEFAULT_THRESHOLD = 0.65  # λ of NVIDIA's published Wan 2.2 curve at s = 0.65, 720p × 81 frames
PROBE_TOKENS, PROBE_PADDING = 256, 64  # the mask probe: 256 tokens, the last 64 padding (masked out)

# Real text encoder sizes (their configs on the Hub): Wan's UMT5-XXL encoder, HunyuanVideo 1.5's Qwen2.5-VL-7B
# text model and its ByT5 glyph encoder.
UMT5_XXL = dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                relative_attention_num_buckets=32, relative_attention_max_distance=128,
                feed_forward_proj="gated-gelu", tie_word_embeddings=False)
QWEN25_VL_7B_TEXT = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                         num_attention_heads=28, num_key_value_heads=4, rms_norm_eps=1e-6,
                         rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]})
BYT5_GLYPH = dict(vocab_size=384, d_model=1472, d_kv=64, d_ff=3584, num_layers=12, num_heads=6,
                  feed_forward_proj="gated-gelu")
WAN_TEXT_TOKENS = 512
HUNYUAN_TEMPLATE_TOKENS = 108  # the chat template prefix the pipeline crops (prompt_template_encode_start_idx)


@contextlib.contextmanager
def building_on(device: torch.device, dtype: torch.dtype):
    """Modules constructed inside get ``dtype`` parameters allocated on ``device`` (random init there)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            yield
    finally:
        torch.set_default_dtype(previous)


def full_wan_pipeline(entry: ModelEntry, device: torch.device, dtype: torch.dtype):
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline
    from transformers import UMT5Config, UMT5EncoderModel

    from diffusers_trtllm.tiny_pipelines import byte_tokenizer

    experts = [build_transformer(entry, entry.speed, device, dtype) for _ in range(2)]
    with building_on(device, dtype):
        text_encoder = UMT5EncoderModel(UMT5Config(**UMT5_XXL)).eval()
    with building_on(device, torch.float32):
        vae = AutoencoderKLWan().eval()  # the class defaults are the Wan 2.1 VAE that A14B uses
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        num_train_timesteps=1000, flow_shift=3.0)
    return WanPipeline(tokenizer=byte_tokenizer(WAN_TEXT_TOKENS), text_encoder=text_encoder, vae=vae,
                       scheduler=scheduler, transformer=experts[0], transformer_2=experts[1], boundary_ratio=0.875)


def full_hunyuan_pipeline(entry: ModelEntry, device: torch.device, dtype: torch.dtype):
    from diffusers import AutoencoderKLHunyuanVideo15, FlowMatchEulerDiscreteScheduler, HunyuanVideo15Pipeline
    from diffusers.guiders import ClassifierFreeGuidance
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config, T5EncoderModel

    from diffusers_trtllm.tiny_pipelines import chat_byte_tokenizer

    transformer = build_transformer(entry, entry.speed, device, dtype)
    with building_on(device, dtype):
        text_encoder = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(**QWEN25_VL_7B_TEXT)).eval()
        text_encoder_2 = T5EncoderModel(T5Config(**BYT5_GLYPH)).eval()
        vae = AutoencoderKLHunyuanVideo15().eval()  # the class defaults: 32 latent channels, 16× / 4×
    pipe = HunyuanVideo15Pipeline(
        text_encoder=text_encoder, tokenizer=chat_byte_tokenizer(4096), text_encoder_2=text_encoder_2,
        tokenizer_2=ByT5Tokenizer(), vae=vae, transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0), guider=ClassifierFreeGuidance(guidance_scale=6.0))
    # one character per token: a system message of 107 characters + its newline is the 108-token prefix the
    # pipeline crops, so the encoder sees 1,000 + 108 tokens as with the real tokenizer
    pipe.system_message = pipe.system_message[:HUNYUAN_TEMPLATE_TOKENS - 1]
    pipe.prompt_template_encode_start_idx = HUNYUAN_TEMPLATE_TOKENS
    return pipe


@dataclass(frozen=True)
class VideoModel:
    """A pipeline to time: its entry in ``examples/evaluation``'s models, the steps a video takes, the call's
    guidance arguments, builders (full size on a device; tiny on the CPU), and whether its default attention
    passes a mask (what a diffusers backend must accept)."""

    key: str
    video_steps: int
    call_kwargs: dict
    build_full: Callable
    tiny_builder: str
    masked_attention: bool
    vae_tiling: bool

    @property
    def entry(self) -> ModelEntry:
        return find_model(self.key)

    def build(self, tiny: bool, device: torch.device, dtype: torch.dtype):
        if tiny:
            from diffusers_trtllm import tiny_pipelines

            pipe = getattr(tiny_pipelines, self.tiny_builder)().to(device)
        else:
            pipe = self.build_full(self.entry, device, dtype)
        if self.vae_tiling:
            pipe.vae.enable_tiling()
        pipe.set_progress_bar_config(disable=True)
        return pipe


VIDEO_MODELS = {
    "wan": VideoModel("wan", 40, dict(guidance_scale=4.0, guidance_scale_2=3.0), full_wan_pipeline,
                      "tiny_wan22_pipeline", masked_attention=False, vae_tiling=False),
    # diffusers' HunyuanVideo 1.5 example decodes with tiling; untiled 720p decoding needs far more memory
    "hunyuan": VideoModel("hunyuan", 50, {}, full_hunyuan_pipeline, "tiny_hunyuan_video15_pipeline",
                          masked_attention=True, vae_tiling=True),
}


# ------------------------------------------------------------------------------------------------ configurations


@dataclass(frozen=True)
class VideoConfig:
    """A row: this package installed with ``attention``, diffusers' attention ``backend`` set, or neither
    (diffusers' default processors). The ratios refer to the best of diffusers' own rows."""

    label: str
    attention: AttentionConfig | None = None
    backend: str | None = None

    @property
    def diffusers(self) -> bool:
        return self.attention is None

    def installed(self, pipe) -> contextlib.AbstractContextManager:
        if self.attention is not None:
            # no statistics: counting skipped tiles is extra work that a user's video does not pay
            return enable_trtllm_attention(pipe, self.attention, collect_stats=False)
        if self.backend is not None:
            return diffusers_backend(pipe, self.backend)
        return contextlib.nullcontext()


def diffusers_backend_names() -> list[str]:
    """Every attention backend diffusers offers except ``native`` (its default: the ``diffusers`` row), PyTorch's
    and flex first; ``_native_math`` last: it materialises the S × S scores, which a 720p video does not fit."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    names = [member.value for member in AttentionBackendName
             if member.value not in ("native", TRTLLM_DISPATCH_BACKEND)]  # this package's own backend is no peer
    first = [name for name in names if name.startswith("_native") and name != "_native_math"] + ["flex"]
    return first + [name for name in names if name not in first and name != "_native_math"] + ["_native_math"]


@contextlib.contextmanager
def diffusers_backend(pipe, name: str):
    transformers = list(pipeline_transformers(pipe).values())
    try:
        for transformer in transformers:
            transformer.set_attention_backend(name)
        yield
    finally:
        for transformer in transformers:
            transformer.reset_attention_backend()


def video_configs(names: list[str], entry: ModelEntry, feature_backend: str, threshold: float) -> list[VideoConfig]:
    """The rows for ``names`` in order (``backends`` expanded in place, duplicates dropped)."""
    expanded = []
    for name in names:
        for item in ([f"{DIFFUSERS_DEFAULT}:{b}" for b in diffusers_backend_names()] if name == BACKENDS_GROUP
                     else [name]):
            if item not in expanded:
                expanded.append(item)
    fp8 = AttnQuantSpec(dtype_qk="fp8_e4m3")
    package = {
        "dense": (f"{feature_backend} dense", {}),
        "sage": (f"{feature_backend} SAGE fp8", dict(quant=fp8)),
        "sage_skip": (f"{feature_backend} SAGE fp8 + skip λ={threshold:g}",
                      dict(quant=fp8, skip={"threshold": threshold})),
    }
    configs = []
    for item in expanded:
        if item == DIFFUSERS_DEFAULT:
            configs.append(VideoConfig("diffusers default processors"))
        elif item.startswith(f"{DIFFUSERS_DEFAULT}:"):
            backend = item.split(":", 1)[1]
            configs.append(VideoConfig(f"diffusers backend {backend}", backend=backend))
        else:
            label, features = package[item]
            configs.append(VideoConfig(label, attention_config(feature_backend, sdpa_roles=entry.sdpa_roles,
                                                               **features)))
    return configs


def config_name_error(name: str) -> str | None:
    """Why ``name`` is no ``--configs`` value, or None."""
    if name in (DIFFUSERS_DEFAULT, BACKENDS_GROUP, *PACKAGE_CONFIGS):
        return None
    if name.startswith(f"{DIFFUSERS_DEFAULT}:"):
        backend = name.split(":", 1)[1]
        if backend in diffusers_backend_names():
            return None
        return (f"--configs {name!r}: diffusers 0.42 has no attention backend {backend!r}; valid: "
                f"{', '.join(diffusers_backend_names())}")
    return (f"--configs {name!r} is invalid: expected {DIFFUSERS_DEFAULT}, {DIFFUSERS_DEFAULT}:BACKEND, "
            f"{BACKENDS_GROUP}, {', '.join(PACKAGE_CONFIGS)}")


def probe_backend(pipe, bench: VideoConfig, dtype: torch.dtype, device: torch.device, masked: bool) -> None:
    """Set diffusers' backend of ``bench`` (which checks the packages it needs) and run it once at a small size
    with the attention mask the model's default processor passes (HunyuanVideo 1.5: a boolean ``[B, 1, S, S]``
    mask over padded text), so a backend that refuses the model's attention does so before anything compiles."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    config = pipe.transformer.config
    q, k, v = (torch.randn(1, PROBE_TOKENS, config.num_attention_heads, config.attention_head_dim, dtype=dtype,
                           device=device) for _ in range(3))
    mask = None
    if masked:
        valid = torch.arange(PROBE_TOKENS, device=device) < PROBE_TOKENS - PROBE_PADDING
        mask = (valid[:, None] & valid[None, :])[None, None]
    with bench.installed(pipe):
        dispatch_attention_fn(q, k, v, attn_mask=mask, backend=bench.backend)
    synchronize(device)


# ------------------------------------------------------------------------------------------------ timing


class PhaseClock:
    """Wall-clock phases of one pipeline call (the device synchronised at each mark): text encoding ends with the
    last ``encode_prompt``, denoising with the start of ``vae.decode`` (or the call, for latent output)."""

    def __init__(self, pipe, device: torch.device):
        self.pipe, self.device = pipe, device
        self.start = self.text_end = self.decode_start = self.end = None

    def _now(self) -> float:
        synchronize(self.device)
        return time.perf_counter()

    def __enter__(self) -> "PhaseClock":
        encode, decode = self.pipe.encode_prompt, self.pipe.vae.decode

        def timed_encode(*args, **kwargs):
            out = encode(*args, **kwargs)
            self.text_end = self._now()
            return out

        def timed_decode(*args, **kwargs):
            self.decode_start = self._now()
            return decode(*args, **kwargs)

        self.pipe.encode_prompt, self.pipe.vae.decode = timed_encode, timed_decode
        self.start = self._now()
        return self

    def __exit__(self, *exc) -> None:
        self.end = self._now()
        del self.pipe.encode_prompt, self.pipe.vae.decode

    @property
    def text_s(self) -> float:
        return self.text_end - self.start

    @property
    def denoise_s(self) -> float:
        return (self.decode_start or self.end) - self.text_end

    @property
    def decode_s(self) -> float | None:
        return None if self.decode_start is None else self.end - self.decode_start


@contextlib.contextmanager
def repeated_blocks_compiled(pipe, compile_backend: str | None):
    """Every transformer compiled with ``compile_repeated_blocks(fullgraph=True)`` while inside (``inductor``:
    what users run; ``eager``: Dynamo's tracing only, for CPU tests; None: not compiled); undone after, with
    dynamo's caches reset so the next row compiles from scratch."""
    transformers = list(pipeline_transformers(pipe).values()) if compile_backend else []
    options = {"fullgraph": True} if compile_backend == "inductor" else {"fullgraph": True, "backend": compile_backend}
    try:
        for transformer in transformers:
            transformer.compile_repeated_blocks(**options)
        yield
    finally:
        for transformer in transformers:
            for module in transformer.modules():
                if type(module).__name__ in transformer._repeated_blocks:
                    module._compiled_call_impl = None
        if transformers:
            torch._dynamo.reset()


@contextlib.contextmanager
def first_blocks_only(pipe, blocks_attr: str):
    with contextlib.ExitStack() as stack:
        for transformer in pipeline_transformers(pipe).values():
            stack.enter_context(first_block_only(transformer, blocks_attr))
        yield


@dataclass
class Row:
    label: str
    diffusers: bool
    steps_run: int | None = None
    warmup_s: float | None = None
    text_s: float | None = None
    denoise_s: float | None = None
    per_step_s: float | None = None
    transformer_calls: int | None = None
    per_call_s: float | None = None
    decode_s: float | None = None
    decode_shared: bool = False
    video_s: float | None = None
    vs_best_diffusers: float | None = None
    peak_gb: float | None = None
    error: str = ""


def one_line(error: BaseException) -> str:
    message = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {message}"[:300]


def time_config(pipe, model: VideoModel, bench: VideoConfig, shape: VideoShape, args, device, decode: bool) -> Row:
    """Warm-up call, then the timed call; raises what the configuration raises."""
    row = Row(bench.label, bench.diffusers, steps_run=args.steps)
    call = dict(prompt=PROMPT, height=shape.height, width=shape.width, num_frames=shape.frames,
                generator=torch.Generator().manual_seed(0), **model.call_kwargs)
    blocks_attr = model.entry.speed.blocks_attr
    with bench.installed(pipe), repeated_blocks_compiled(pipe, args.compile_backend), torch.no_grad():
        start = time.perf_counter()
        with first_blocks_only(pipe, blocks_attr):
            latents = pipe(**call, num_inference_steps=WARMUP_STEPS, output_type="latent").frames
        if decode:  # the first decode loads the VAE's kernels: a short clip of the same size does it
            pipe.vae.decode(latents[:, :, :2].to(pipe.vae.dtype))
        synchronize(device)
        row.warmup_s = time.perf_counter() - start
        del latents
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        with TransformerTimer.for_pipeline(pipe) as timer, PhaseClock(pipe, device) as clock:
            pipe(**call, num_inference_steps=args.steps, output_type="np" if decode else "latent")
    calls = timer.seconds()
    row.text_s, row.denoise_s, row.decode_s = clock.text_s, clock.denoise_s, clock.decode_s
    row.per_step_s = row.denoise_s / args.steps
    row.transformer_calls, row.per_call_s = len(calls), sum(calls) / len(calls)
    if device.type == "cuda":
        row.peak_gb = torch.cuda.max_memory_allocated(device) / 1e9
    return row


def run_model(model: VideoModel, pipe, configs: list[VideoConfig], shape: VideoShape, args, device, dtype,
              deadline: float, write: Callable[[list[Row]], None]) -> list[Row]:
    """One row per configuration, written out after each (a run cut short keeps what it measured)."""
    rows: list[Row] = []
    shared_decode: Row | None = None
    progress = tqdm(configs, desc=model.entry.name, unit="config", file=sys.stderr)
    for bench in progress:
        progress.set_postfix_str(bench.label)
        rows.append(measure_row(pipe, model, bench, shape, args, device, dtype, deadline, shared_decode))
        row = rows[-1]
        if row.error:  # outside the except block, which kept the failed call's tensors alive (an OOM's)
            free(device)
        elif shared_decode is None:
            shared_decode = row
        finish_rows(rows, model.video_steps)
        write(rows)
    return rows


def measure_row(pipe, model: VideoModel, bench: VideoConfig, shape: VideoShape, args, device, dtype,
                deadline: float, shared_decode: Row | None) -> Row:
    """The row of ``bench``: timed, or the reason it was not (time budget spent, a backend refusing the model's
    attention, an error); a row after the first that decoded carries that row's decode time."""
    if bench.backend is not None:  # probed even past the deadline: a refusal takes no time and says why
        try:
            probe_backend(pipe, bench, dtype, device, model.masked_attention)
        except Exception as e:  # noqa: BLE001  (a refusal is a row saying why)
            return Row(bench.label, bench.diffusers, error=f"refused: {one_line(e)}")
    if time.perf_counter() > deadline:
        return Row(bench.label, bench.diffusers, error="not run: time budget spent")
    try:
        row = time_config(pipe, model, bench, shape, args, device, decode=shared_decode is None)
    except Exception as e:  # noqa: BLE001  (record and go on: one failure must not lose the run)
        return Row(bench.label, bench.diffusers, error=one_line(e))
    if shared_decode is not None:
        row.decode_s, row.decode_shared = shared_decode.decode_s, True
    return row


def finish_rows(rows: list[Row], video_steps: int) -> None:
    """Seconds per video (denoising scaled to ``video_steps``) and the ratio to the best diffusers row."""
    for row in rows:
        if row.per_step_s is not None and row.decode_s is not None:
            row.video_s = row.text_s + row.per_step_s * video_steps + row.decode_s
    best = min((r.video_s for r in rows if r.diffusers and r.video_s is not None), default=None)
    for row in rows:
        row.vs_best_diffusers = best / row.video_s if best is not None and row.video_s is not None else None


# ------------------------------------------------------------------------------------------------ report


def report(result: dict) -> str:
    shape, steps, video_steps = result["shape"], result["steps"], result["video_steps"]
    rows = result["rows"]
    best = min((r for r in rows if r["diffusers"] and r["video_s"] is not None), key=lambda r: r["video_s"],
               default=None)
    title = (f"### {result['model']}: {shape['width']}×{shape['height']}, {shape['frames']} frames, CFG, "
             f"{video_steps} steps ({steps} run, denoising scaled ×{video_steps / steps:g})")
    table = markdown_table(
        ("configuration", "text encoding (s)", "denoising / step (s)", f"denoising, {video_steps} steps (s)",
         "transformer call (s)", "VAE decode (s)", "seconds per video", "× best diffusers", "warm-up (s)",
         "peak GB", "notes"),
        [(r["label"], format_number(r["text_s"], 2), format_number(r["per_step_s"], 2),
          format_number(r["per_step_s"] * video_steps if r["per_step_s"] is not None else None, 1),
          format_number(r["per_call_s"], 2),
          format_number(r["decode_s"], 1) + ("*" if r["decode_shared"] else ""),
          format_number(r["video_s"], 1), format_number(r["vs_best_diffusers"], 3, "×"),
          format_number(r["warmup_s"], 1), format_number(r["peak_gb"], 1), r["error"]) for r in rows],
        "lrrrrrrrrrl")
    lines = [title, "", table, "",
             f"best diffusers configuration: {best['label'] if best else 'none ran'}. Warm-up: a {WARMUP_STEPS}-step "
             "call with each transformer's first block only (compiles, builds kernels), not counted. "
             "* decode time of the first row that decoded (the VAE does not depend on the attention "
             "configuration)."]
    if not result["tiny"]:
        lines.append("Random weights at full size; text encoders at their real size behind character-level "
                     "tokenizers padded to the pipelines' lengths (the real vocabularies need downloads).")
    if result.get("kernel_build"):
        lines.append(f"TRTLLM_ATTN kernel builds before the first row: {result['kernel_build']}")
    return "\n".join(lines) + "\n"


def parse_args(argv):
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(VIDEO_MODELS), default="wan")
    parser.add_argument("--steps", type=positive_int, default=2, help="denoising steps run per timed call")
    parser.add_argument("--scale-to", type=positive_int, default=None,
                        help="steps per video that denoising is scaled to (default: 40 Wan, 50 HunyuanVideo 1.5)")
    parser.add_argument("--configs", nargs="+", default=None,
                        help=f"rows, in order: {DIFFUSERS_DEFAULT}, {DIFFUSERS_DEFAULT}:BACKEND, {BACKENDS_GROUP} "
                             f"(every diffusers backend), {', '.join(PACKAGE_CONFIGS)} (default: "
                             f"{DIFFUSERS_DEFAULT} {' '.join(PACKAGE_CONFIGS)}, and {BACKENDS_GROUP} for hunyuan)")
    parser.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD, help="Skip-Softmax λ of sage_skip")
    parser.add_argument("--height", type=positive_int, default=None)
    parser.add_argument("--width", type=positive_int, default=None)
    parser.add_argument("--frames", type=positive_int, default=None, help="4k + 1")
    parser.add_argument("--compile", dest="compile_backend", choices=("inductor", "eager", "none"),
                        default="inductor", help="compile_repeated_blocks backend (eager: tracing only; none: off)")
    parser.add_argument("--time-budget", type=float, default=480.0,
                        help="seconds after start past which remaining configurations are recorded as not run")
    parser.add_argument("--tiny", action="store_true", help="the tiny pipelines on the CPU (a smoke test)")
    parser.add_argument("--json", type=Path, default=None,
                        help="JSON output (default: $OUT/video_seconds_MODEL.json, or ./video_seconds_MODEL.json)")
    args = parser.parse_args(argv)
    model = VIDEO_MODELS[args.model]
    args.compile_backend = None if args.compile_backend == "none" else args.compile_backend
    args.scale_to = args.scale_to or model.video_steps
    if args.steps > args.scale_to:
        parser.error(f"--steps {args.steps} is more than the {args.scale_to} steps per video it is scaled to "
                     "(--scale-to)")
    default_shape = TINY_SHAPE if args.tiny else model.entry.speed.shape
    args.height = args.height or default_shape.height
    args.width = args.width or default_shape.width
    args.frames = args.frames or default_shape.frames
    for flag in ("height", "width"):
        if getattr(args, flag) % 16:
            parser.error(f"--{flag} {getattr(args, flag)} is invalid: expected a multiple of 16 (VAE × patch)")
    if args.frames % 4 != 1:
        parser.error(f"--frames {args.frames} is invalid: expected 4k + 1 (the VAE compresses time 4×)")
    if not args.threshold > 0:
        parser.error(f"--threshold {args.threshold} is invalid: expected λ > 0")
    if not args.time_budget > 0:
        parser.error(f"--time-budget {args.time_budget} is invalid: expected seconds > 0")
    args.configs = args.configs or [DIFFUSERS_DEFAULT, *PACKAGE_CONFIGS, *([BACKENDS_GROUP] if model.masked_attention
                                                                          else [])]
    for name in args.configs:
        reason = config_name_error(name)
        if reason:
            parser.error(reason)
    if not args.tiny and not torch.cuda.is_available():
        parser.error(f"this torch ({torch.__version__}) sees no CUDA GPU; use --tiny on a CPU")
    args.device = torch.device("cpu" if args.tiny else "cuda")
    with user_errors(parser):
        configs = video_configs(args.configs, model.entry, TORCH_REFERENCE if args.tiny else TRTLLM_ATTN,
                                args.threshold)
    check_backends(parser, [c.attention for c in configs if c.attention is not None], args.device)
    return model, configs, args


def main(argv=None) -> dict:
    model, configs, args = parse_args(argv)
    start = time.perf_counter()
    device, dtype = args.device, torch.float32 if args.tiny else torch.bfloat16
    shape = VideoShape(args.height, args.width, args.frames)
    output = args.json or Path(os.environ.get("OUT", ".")) / f"video_seconds_{args.model}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    result = {"model": model.entry.name, "shape": vars(shape), "steps": args.steps, "video_steps": args.scale_to,
              "threshold": args.threshold, "compile": args.compile_backend or "none", "tiny": args.tiny,
              "torch": torch.__version__, "diffusers": diffusers.__version__,
              "transformers": transformers.__version__,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "rows": []}
    built = time.perf_counter()
    pipe = model.build(args.tiny, device, dtype)
    result["build_s"] = time.perf_counter() - built
    if device.type == "cuda" and any(not c.diffusers for c in configs):  # after the build, which fails faster
        result["kernel_build"] = trtllm_warmup(device)
    result["params"] = {name: sum(p.numel() for p in component.parameters())
                        for name, component in pipe.components.items() if isinstance(component, torch.nn.Module)}

    def write(rows):  # after every row: a run stopped by the device's time limit keeps what it measured
        result["rows"] = [dataclasses.asdict(r) for r in rows]
        result["total_s"] = time.perf_counter() - start
        output.write_text(json.dumps(result, indent=1, default=str))
        output.with_suffix(".md").write_text(report(result))

    write([])
    run_model(model, pipe, configs, shape, args, device, dtype, start + args.time_budget, write)
    text = report(result)
    print(text)
    print(f"wrote {output} and {output.with_suffix('.md').name} ({result['total_s']:.0f} s)")
    return {**result, "markdown": text, "output": output}


if __name__ == "__main__":
    main()
