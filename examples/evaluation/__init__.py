"""Pieces shared by the examples (``demo.py``, ``generate.py``, ``evaluate.py``, ``calibrate.py``) and
``benchmarks/transformer_step.py``: not part of the library. The examples import it from their own folder
(``from evaluation import ...``); the benchmark puts ``examples/`` on ``sys.path``.

- :mod:`.cli`: the command-line conventions (one line on stderr, exit status 2, checked before the work);
- :mod:`.models`: :data:`MODELS`, the models of the test plan by id (pipeline class, test-plan shape, tiny builder,
  and the real transformer configuration for the random-weight speed run); loading and running a pipeline to
  video frames, exporting them;
- :mod:`.shapes`: the sizes and frame counts each model takes (:class:`ShapeRule`), checked before any work;
- :mod:`.timing`: timing its transformer calls (:class:`TransformerTimer`);
- :mod:`.configs`: the test plan's attention configurations (:func:`test_plan_configs`) and a SageAttention peer
  (:func:`sageattention_peer`), patched in through a temporarily replaced ``TORCH_SDPA`` backend;
- :mod:`.metrics`: video metrics: PSNR, SSIM (here, in torch) and LPIPS (AlexNet, from the ``lpips`` package when
  it can load);
- :mod:`.what_ran`: what ran per step and layer (:func:`sparsity_grid`, :func:`describe_attention_plan`);
- :mod:`.reports`: Markdown tables, plots, :class:`RunRecord` and the test plan's tables (:func:`plan_tables`).

Heavy or optional imports (diffusers pipelines, matplotlib, lpips, sageattention) happen inside the functions
that need them: the speed benchmark runs on a GPU machine that has none of the plotting or metric packages.
"""

from .configs import (PLAN_GATES, REFERENCE_LABEL, SAGE_ATTN_LABEL, TABLE_BACKENDS, TABLE_SAGE, TABLE_SAGE_SKIP,
                      TABLE_SKIP, EvalConfig, attention_config, backend_label, describe_config, no_attention, open_gate,
                      replaced_backend, sageattention_peer, sageattention_unavailable_reason, skip_settings,
                      test_plan_configs)
from .metrics import LpipsScorer, psnr, ssim
from .models import (MODELS, TINY_SHAPE, ModelEntry, ModelLoadError, SpeedRun, VideoShape, entry_for_folder,
                     export_frames, find_model, from_pretrained, generate_frames, load_model, load_pipeline,
                     resolve_model)
from .reports import (PLAN_TABLES, RESULT_ALIGN, RESULT_COLUMNS, RunRecord, format_number, markdown_table,
                      plan_tables, plot_quality_vs_speedup, plot_sparsity)
from .shapes import ShapeRule, shape_rule_of
from .timing import TransformerTimer, synchronize
from .what_ran import compress_layer_names, describe_attention_plan, sparsity_grid

__all__ = [
    # models
    "MODELS", "TINY_SHAPE", "ModelEntry", "ModelLoadError", "SpeedRun", "VideoShape", "entry_for_folder",
    "export_frames", "find_model", "from_pretrained", "generate_frames", "load_model", "load_pipeline",
    "resolve_model",
    # shapes
    "ShapeRule", "shape_rule_of",
    # timing
    "TransformerTimer", "synchronize",
    # configs
    "PLAN_GATES", "REFERENCE_LABEL", "SAGE_ATTN_LABEL", "TABLE_BACKENDS", "TABLE_SAGE", "TABLE_SAGE_SKIP",
    "TABLE_SKIP", "EvalConfig", "attention_config", "backend_label", "describe_config", "no_attention", "open_gate",
    "replaced_backend", "sageattention_peer", "sageattention_unavailable_reason", "skip_settings",
    "test_plan_configs",
    # metrics
    "LpipsScorer", "psnr", "ssim",
    # what ran
    "compress_layer_names", "describe_attention_plan", "sparsity_grid",
    # reports
    "PLAN_TABLES", "RESULT_ALIGN", "RESULT_COLUMNS", "RunRecord", "format_number", "markdown_table", "plan_tables",
    "plot_quality_vs_speedup", "plot_sparsity",
]
