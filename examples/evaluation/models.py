"""The test plan's models (:data:`MODELS`): pipeline class, test-plan shape, tiny builder, and the real
transformer configuration for the random-weight speed run; loading and running a pipeline to video frames, and
exporting them to MP4.

diffusers itself (pretrained pipelines, ``export_to_video``) and the tiny pipelines are imported inside the
functions that need them.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import torch

from .shapes import ShapeRule


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
        """Video tokens the transformer sees: latent frames × rows × columns after patchifying (a partial patch
        counts whole: Cosmos 3 pads the latent to whole patches)."""
        frames, rows, cols = self.latent_shape(1)[2:]
        return -(-frames // self.patch[0]) * -(-rows // self.patch[1]) * -(-cols // self.patch[2])


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


def _cosmos3_step_inputs(run: SpeedRun, device: torch.device, dtype: torch.dtype) -> dict:
    """Text-to-video: the text prompt (the causal stream) then every vision token noisy, as the pipeline packs
    them; positions are plain counters on all three mRoPE axes (they change the rotary's values, not its cost)."""
    cfg = run.transformer_config
    (text_tokens,) = run.context_tokens
    latent = torch.randn(run.latent_shape(cfg["latent_channel"]), device=device, dtype=dtype)
    frames, rows, cols = latent.shape[2:]
    patch = cfg["latent_patch_size"]
    grid = (frames, -(-rows // patch), -(-cols // patch))
    vision_tokens = grid[0] * grid[1] * grid[2]
    total = text_tokens + vision_tokens
    vision_indexes = torch.arange(text_tokens, total, device=device)
    return dict(input_ids=torch.randint(0, cfg["vocab_size"], (text_tokens,), device=device),
                text_indexes=torch.arange(text_tokens, device=device),
                position_ids=torch.arange(total, device=device).expand(3, -1), und_len=text_tokens,
                sequence_length=total, vision_tokens=[latent], vision_token_shapes=[grid],
                vision_sequence_indexes=vision_indexes, vision_mse_loss_indexes=vision_indexes,
                vision_timesteps=torch.full((vision_tokens,), 500.0, device=device),
                vision_noisy_frame_indexes=[torch.arange(frames, device=device)], return_dict=False)


@dataclass(frozen=True)
class ModelEntry:
    """One model of the test plan.

    ``sdpa_roles``: roles or categories that stay dense on TORCH_SDPA in every TRT-LLM configuration (Wan's
    cross-attention: 512 text keys, a few percent of attention time, faster on cuDNN than on FMHAv2 and not
    proven on it for fewer queries than keys). Cosmos 3's causal text stream needs no entry: under a TRTLLM_ATTN
    default it runs dense on TORCH_SDPA by itself (said once at install). ``frames_of`` takes the pipeline output
    (``output_type="np"``) to one video ``[frames, H, W, C]``. ``shape_rule``: the sizes and frame counts the model takes (the same for its
    tiny pipeline; tests/test_cli.py pins it against the built pipelines).
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
    shape_rule: ShapeRule
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

# Cosmos3-Super: two towers shaped like Qwen3-VL-32B's text model, which NVIDIA initialised them from (64 layers,
# hidden 5,120, 64 query / 8 key-value heads of 128, MLP 25,600; inferred, not read from the checkpoint): the
# published 64 B parameters (119 GiB in bf16). The class defaults (hidden 4,096, 36 layers, 32/8 heads) are
# Cosmos3-Nano's.
# The VAE is Wan 2.2's (16× spatial, 4× temporal); latent patches are 2 × 2, the latent padded to whole patches.
_COSMOS3_SUPER_CONFIG = dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                             num_key_value_heads=8, head_dim=128, latent_channel=48, latent_patch_size=2,
                             patch_latent_dim=192, rope_theta=5e6, vocab_size=151936)
# Text tokens of the causal stream: a long prompt with the pipeline's system prompt and its duration and resolution
# sentences (the pipeline does not pad text; the length is the prompt's).
COSMOS3_TEXT_TOKENS = 600

# 9 frames at 128×128 make 192 video tokens for Wan and HunyuanVideo: two 128-key tiles, so skipping can happen.
TINY_SHAPE = VideoShape(128, 128, 9, 4)

MODELS: dict[str, ModelEntry] = {entry.model_id: entry for entry in (
    ModelEntry(
        name="Wan 2.2 A14B", model_id="Wan-AI/Wan2.2-T2V-A14B-Diffusers", aliases=("wan", "wan2.2"),
        pipeline_class="WanPipeline", transformer_class="WanTransformer3DModel",
        shape=VideoShape(720, 1280, 81, 50), fps=16,
        tiny_builder="tiny_wan22_pipeline", tiny_shape=TINY_SHAPE, frames_of=_first_video,
        shape_rule=ShapeRule(vae_spatial=8, patch_spatial=2, vae_temporal=4), sdpa_roles=("cross",),
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
        shape_rule=ShapeRule(vae_spatial=16, patch_spatial=1, vae_temporal=4),
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
        shape_rule=ShapeRule(vae_spatial=8, patch_spatial=1, vae_temporal=4),  # the pipeline pads partial patches
        # the pipeline's defaults: 720p, 189 frames (48 latent frames × 23 × 40 patches = 44,160 vision tokens)
        speed=SpeedRun(_COSMOS3_SUPER_CONFIG, VideoShape(720, 1280, 189), (4, 16), (1, 2, 2), (COSMOS3_TEXT_TOKENS,),
                       "layers", _cosmos3_step_inputs),
        tiny_speed=SpeedRun(dict(_COSMOS3_SUPER_CONFIG, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, latent_channel=16,
                                 patch_latent_dim=64, vocab_size=260, rope_axes_dim=(4, 2, 2)),
                            VideoShape(128, 128, 9), (4, 16), (1, 2, 2), (24,), "layers", _cosmos3_step_inputs)),
)}


class ModelLoadError(RuntimeError):
    """A model id, alias or folder that names no evaluated model or cannot be loaded; the message says which and
    why, in one line."""


def find_model(name: str) -> ModelEntry:
    """The entry whose model id or alias is ``name`` (case-insensitive), or a :class:`ModelLoadError` listing
    them."""
    low = name.lower()
    for entry in MODELS.values():
        if low == entry.model_id.lower() or low in entry.aliases:
            return entry
    raise ModelLoadError(f"unknown model {name!r}; known: {_known_models()}, or a local pipeline folder")


def _known_models() -> str:
    return ", ".join(f"{e.model_id} ({'/'.join(e.aliases)})" for e in MODELS.values())


def looks_like_a_path(name: str) -> bool:
    """Whether ``name`` can only be meant as a local path: absolute, starting with ``.`` or ``~``, ending with a
    separator, or with more parts than a Hub id's ``owner/name``."""
    return name.startswith((".", "/", "~")) or name.endswith("/") or "\\" in name or name.count("/") > 1


def resolve_model(name: str | None, option: str = "--model") -> tuple[ModelEntry, Path | None]:
    """``(entry, folder)`` for a command line's model (``option`` names it in errors): None (the first model,
    Wan 2.2), a local pipeline folder (its entry from the pipeline class its ``model_index.json`` names, read
    without loading anything), or a known model id or alias (folder None). A missing folder is said to be one
    when ``name`` can only be a path."""
    if name is None:
        return next(iter(MODELS.values())), None
    path = Path(name).expanduser()
    if path.is_dir():
        return entry_for_folder(path), path
    if path.exists():
        raise ModelLoadError(f"{option} {name}: a file, not a pipeline folder or model id")
    if looks_like_a_path(name):
        raise ModelLoadError(f"{option} {name}: no such folder")
    try:
        return find_model(name), None
    except ModelLoadError:
        raise ModelLoadError(f"unknown model {name!r}, and no folder of that name here; known: {_known_models()}, "
                             "or a local pipeline folder") from None


def entry_for_folder(folder: Path) -> ModelEntry:
    """The entry of the pipeline class that ``folder/model_index.json`` names."""
    index = folder / "model_index.json"
    if not index.is_file():
        raise ModelLoadError(f"{str(folder)!r} is not a pipeline folder: it has no model_index.json")
    try:
        cls = json.loads(index.read_text()).get("_class_name")
    except (ValueError, AttributeError) as e:
        raise ModelLoadError(f"{str(index)!r} is not a pipeline's model_index.json: {e}") from None
    for entry in MODELS.values():
        if entry.pipeline_class == cls:
            return entry
    raise ModelLoadError(f"{str(folder)!r} holds a {cls}, none of the evaluated pipelines "
                         f"{[e.pipeline_class for e in MODELS.values()]}")


class _HubUnreachable(logging.Filter):
    """Drops diffusers' "Couldn't connect to the Hub ... Will try to load from local cache" warning: when the
    cache lacks the model, :class:`ModelLoadError` says so in one line; when it has it, nothing is wrong."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Couldn't connect to the Hub")


def from_pretrained(pipeline_class: str, source: str, dtype: torch.dtype):
    """``diffusers.<pipeline_class>.from_pretrained(source)``; a model that cannot be found or read (offline and
    not cached, a wrong path, a folder of another pipeline) raises :class:`ModelLoadError` in one line."""
    import diffusers

    hub_logger, quiet = logging.getLogger("diffusers.pipelines.pipeline_utils"), _HubUnreachable()
    hub_logger.addFilter(quiet)
    try:
        return getattr(diffusers, pipeline_class).from_pretrained(source, dtype=dtype)
    except (OSError, ValueError) as e:  # what from_pretrained raises for a missing, uncached or foreign model
        # diffusers points at "the stacktrace above", which a one-line error does not show: its cause goes in
        reason = " ".join(str(e).replace("Please check out the root cause in the stacktrace above.", "").split())
        if e.__cause__ is not None:
            reason += f" ({type(e.__cause__).__name__}: {' '.join(str(e.__cause__).split())})"
        raise ModelLoadError(f"cannot load {source!r} with {pipeline_class}: {reason}") from e
    finally:
        hub_logger.removeFilter(quiet)


def load_pipeline(entry: ModelEntry, *, tiny: bool, device: str, dtype: torch.dtype, source: str | None = None):
    """The tiny random pipeline of ``entry`` (from :mod:`diffusers_trtllm.tiny_pipelines`) or the pretrained one
    from ``source`` (default: its model id)."""
    if tiny:
        from diffusers_trtllm import tiny_pipelines

        builder = getattr(tiny_pipelines, entry.tiny_builder, None)
        if builder is None:
            raise ValueError(f"no tiny pipeline for {entry.name}: diffusers_trtllm.tiny_pipelines has no "
                             f"{entry.tiny_builder}()")
        return builder().to(device)
    return from_pretrained(entry.pipeline_class, source or entry.model_id, dtype).to(device)


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
    """Write ``[frames, C, H, W]`` in [0, 1] to an MP4 with diffusers' ``export_to_video`` through imageio (the
    ``examples`` extra; without it diffusers would fall back to OpenCV)."""
    import imageio  # noqa: F401  (fail here, naming the package, rather than in diffusers' OpenCV fallback)
    from diffusers.utils import export_to_video

    return export_to_video(list(frames.permute(0, 2, 3, 1).clamp(0, 1).numpy()), path, fps=fps)


def load_model(entry: ModelEntry, folder: Path | None, *, tiny: bool, device: str, dtype: torch.dtype):
    """The pipeline of :func:`resolve_model`'s ``(entry, folder)``: the folder's pipeline (e.g. written by
    calibrate.py), the model's pretrained one, or with ``tiny`` the model's tiny random pipeline."""
    if folder is not None:
        return from_pretrained(entry.pipeline_class, str(folder), dtype).to(device)
    return load_pipeline(entry, tiny=tiny, device=device, dtype=dtype)
