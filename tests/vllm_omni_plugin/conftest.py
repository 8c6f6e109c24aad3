"""Fixtures for the vLLM-Omni plugin tests: tiny Wan 2.2 (two experts), HunyuanVideo 1.5 and Cosmos 3 pipeline
directories, vLLM-Omni's real diffusers adapter loading them and generating from them, and vLLM-Omni's log."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch

from diffusers_trtllm.calibration import SkipCalibration, write_calibration
from diffusers_trtllm.tiny_pipelines import tiny_cosmos3_pipeline, tiny_hunyuan_video15_pipeline, tiny_wan22_pipeline

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


@dataclass(frozen=True)
class TinyModel:
    """A tiny pipeline as vLLM-Omni serves it: how it is built, its transformers, the processor class this package
    installs on them (the checkpoint's Skip-Softmax calibration per transformer), what one request asks, and the load-time call arguments and output type."""

    build: Callable
    calibrations: dict[str, SkipCalibration]
    processor: str
    sampling: dict
    call_kwargs: dict = field(default_factory=dict)
    output_type: str = "latent"
    #: attention modules this package leaves to diffusers' processors (module name prefix)
    left_alone: str | None = None


MODELS = {
    "wan22": TinyModel(tiny_wan22_pipeline, CALIBRATIONS, "WanTrtllmAttnProcessor", SAMPLING,
                       {"max_sequence_length": MAX_SEQUENCE_LENGTH}, "pt"),
    "hunyuan_video15": TinyModel(tiny_hunyuan_video15_pipeline, {"transformer": SkipCalibration(a=2.0, b=1.0)},
                                 "HunyuanVideo15TrtllmAttnProcessor",
                                 dict(height=32, width=32, num_frames=5, num_inference_steps=3, seed=0),
                                 left_alone="context_embedder.token_refiner."),
    "cosmos3": TinyModel(tiny_cosmos3_pipeline, {"transformer": SkipCalibration(a=2.0, b=1.0)},
                         "Cosmos3TrtllmAttnProcessor",
                         dict(height=32, width=32, num_frames=5, num_inference_steps=3, guidance_scale=2.0, seed=0)),
}


@pytest.fixture(scope="session")
def saved_pipeline(tmp_path_factory):
    """``saved_pipeline(name)``: the folder of a saved tiny pipeline of :data:`MODELS` (built in code, nothing is
    downloaded) whose transformers' config.json carry the model's Skip-Softmax calibrations."""
    folders = {}

    def folder(name: str):
        if name not in folders:
            path = tmp_path_factory.mktemp(f"tiny_{name}")
            MODELS[name].build(0).save_pretrained(path)
            for component, calibration in MODELS[name].calibrations.items():
                write_calibration(path / component, calibration)
            folders[name] = path
        return folders[name]

    return folder


@pytest.fixture(scope="session")
def pipeline_dir(saved_pipeline):
    """The saved tiny Wan 2.2 A14B-shaped pipeline (two experts, UniPC flow shift 3); the high-noise expert's
    calibration keeps its first self-attention dense."""
    return saved_pipeline("wan22")


def load_adapter(pipeline_dir, attention_config: dict, dtype: torch.dtype = torch.float32, model: str = "wan22"):
    """vLLM-Omni's DiffusersAdapterPipeline with ``--diffusion-load-format diffusers`` and
    ``--diffusion-attention-config attention_config``, loaded on the CPU."""
    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.diffusion.models.diffusers_adapter import DiffusersAdapterPipeline

    od_config = OmniDiffusionConfig.from_kwargs(
        model=str(pipeline_dir), dtype=dtype, diffusion_load_format="diffusers",
        diffusers_call_kwargs=MODELS[model].call_kwargs, output_type=MODELS[model].output_type,
        diffusion_attention_config=attention_config)
    od_config.enrich_config()
    adapter = DiffusersAdapterPipeline(od_config=od_config, device=torch.device("cpu"))
    adapter.load_weights()
    return adapter


def request_batch(sampling: dict = SAMPLING):
    """One text-to-video request, as a diffusion worker hands it to the adapter."""
    from vllm_omni.diffusion.request import OmniDiffusionRequest
    from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    request = OmniDiffusionRequest(prompt={"prompt": PROMPT}, sampling_params=OmniDiffusionSamplingParams(**sampling),
                                   request_id="request-0")
    return DiffusionRequestBatch(requests=[request])


def generate(adapter, sampling: dict = SAMPLING) -> torch.Tensor:
    """One request through the adapter's forward; the video (Wan 2.2: ``[1, F, C, H, W]``) or latents."""
    output = adapter.forward(request_batch(sampling)).output
    return getattr(output, "video", output)  # Cosmos 3's pipeline output has neither frames nor images


class Records(logging.Handler):
    """Keeps the records that reach the logger it is added to."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self, contains: str = "") -> list[str]:
        return [r.getMessage() for r in self.records if contains in r.getMessage()]


@pytest.fixture
def vllm_log():
    """What reaches vLLM-Omni's log: the ``vllm`` logger, the one that vLLM configures with a handler (and
    ``vllm_omni``'s loggers propagate to); a record only logged elsewhere is not in a server's log."""
    import vllm_omni.logger  # noqa: F401  (vLLM-Omni's own logger setup, done when vllm_omni is imported)

    vllm = logging.getLogger("vllm")
    assert vllm.handlers and not vllm.propagate, "vLLM configures its own handler on the 'vllm' logger"
    records = Records()
    vllm.addHandler(records)
    yield records
    vllm.removeHandler(records)


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
