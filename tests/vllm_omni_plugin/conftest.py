"""Fixtures for the vLLM-Omni plugin tests: a tiny two-expert Wan 2.2 pipeline directory, and vLLM-Omni's real
diffusers adapter loading it and generating from it."""

from __future__ import annotations

import pytest
import torch

from diffusers_trtllm.calibration import SkipCalibration, write_calibration
from diffusers_trtllm.tiny_pipelines import tiny_wan22_pipeline

PROMPT = "a red fox in snow"
MAX_SEQUENCE_LENGTH = 16
# One request's sampling settings, and the same as diffusers call arguments (the adapter adds guidance_scale_2 =
# guidance_scale, num_videos_per_prompt and the seeded generator).
SAMPLING = dict(height=32, width=32, num_frames=5, num_inference_steps=6, guidance_scale=2.0, seed=0)
CALL_KWARGS = dict(prompt=PROMPT, max_sequence_length=MAX_SEQUENCE_LENGTH, height=32, width=32, num_frames=5,
                   num_inference_steps=6, guidance_scale=2.0, guidance_scale_2=2.0, num_videos_per_prompt=1,
                   output_type="pt")
# The checkpoint's Skip-Softmax curves; the high-noise expert's ignore list keeps its first self-attention dense.
CALIBRATIONS = {"transformer": SkipCalibration(a=2.0, b=1.0, ignore=("blocks.0.attn1",)),
                "transformer_2": SkipCalibration(a=2.0, b=1.0)}


@pytest.fixture(scope="session")
def pipeline_dir(tmp_path_factory):
    """A saved tiny Wan 2.2 A14B-shaped pipeline (two experts, UniPC flow shift 3, word-level tokenizer built in
    code, so nothing is downloaded) whose transformers' config.json carry a Skip-Softmax calibration."""
    path = tmp_path_factory.mktemp("tiny_wan22")
    tiny_wan22_pipeline(0).save_pretrained(path)
    for component, calibration in CALIBRATIONS.items():
        write_calibration(path / component, calibration)
    return path


def load_adapter(pipeline_dir, attention_config: dict, dtype: torch.dtype = torch.float32):
    """vLLM-Omni's DiffusersAdapterPipeline with ``--diffusion-load-format diffusers`` and
    ``--diffusion-attention-config attention_config``, loaded on the CPU."""
    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.diffusion.models.diffusers_adapter import DiffusersAdapterPipeline

    od_config = OmniDiffusionConfig.from_kwargs(
        model=str(pipeline_dir), dtype=dtype, diffusion_load_format="diffusers",
        diffusers_call_kwargs={"max_sequence_length": MAX_SEQUENCE_LENGTH}, output_type="pt",
        diffusion_attention_config=attention_config)
    od_config.enrich_config()
    adapter = DiffusersAdapterPipeline(od_config=od_config, device=torch.device("cpu"))
    adapter.load_weights()
    return adapter


def generate(adapter) -> torch.Tensor:
    """One request through the adapter's forward, as a diffusion worker runs it; the video ``[1, F, C, H, W]``."""
    from vllm_omni.diffusion.request import OmniDiffusionRequest
    from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    request = OmniDiffusionRequest(prompt={"prompt": PROMPT}, sampling_params=OmniDiffusionSamplingParams(**SAMPLING),
                                   request_id="request-0")
    return adapter.forward(DiffusionRequestBatch(requests=[request])).output


def attention_processors(pipeline) -> dict[str, tuple[str, object]]:
    """Per attention module of both transformers: its processor's class and diffusers dispatcher backend."""
    return {f"{component}.{name}": (type(p).__name__, getattr(p, "_attention_backend", None))
            for component in ("transformer", "transformer_2")
            for name, p in getattr(pipeline, component).attn_processors.items()}


@pytest.fixture(scope="session")
def sdpa_without_plugin(pipeline_dir):
    """TORCH_SDPA through the adapter before any plugin is loaded in this process: processors and video."""
    import vllm_omni.plugins

    assert not vllm_omni.plugins.omni_plugins_loaded, "the baseline must run before the plugins are loaded"
    adapter = load_adapter(pipeline_dir, {"default": {"backend": "TORCH_SDPA"}})
    return attention_processors(adapter._pipeline), generate(adapter)


@pytest.fixture(scope="session")
def plugins_loaded(sdpa_without_plugin):
    """vLLM-Omni's general plugins loaded the way every diffusion worker loads them."""
    from vllm_omni.plugins import load_omni_general_plugins

    load_omni_general_plugins()


@pytest.fixture
def on_reference(monkeypatch):
    """Point this package's TRT-LLM kernel calls at its PyTorch reference (its test seam), with statistics on."""
    from diffusers_trtllm.backends.base import TRTLLM_ON_REFERENCE_ENV
    from diffusers_trtllm.integrations.vllm_omni import COLLECT_STATS_ENV

    monkeypatch.setenv(TRTLLM_ON_REFERENCE_ENV, "1")
    monkeypatch.setenv(COLLECT_STATS_ENV, "1")
