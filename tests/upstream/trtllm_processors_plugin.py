"""pytest plugin: run diffusers' own model tests with this package's attention processors on every model they build.

Load it into a run of diffusers' test tree with ``-p trtllm_processors_plugin`` (this folder on ``PYTHONPATH``;
``run_upstream.py`` does both) and pick the processors with ``--trtllm-processors``:

- ``none``: diffusers' own processors (the baseline the other modes are compared with);
- ``sdpa``: ``TORCH_SDPA``; ``reference-dense``: ``TORCH_REFERENCE``;
- ``reference-skip``: ``TORCH_REFERENCE`` with Skip-Softmax at a fixed λ;
- ``reference-sage``: ``TORCH_REFERENCE`` with SAGE int8 Q/K.

Every model of a class this package serves is given the processors when it is constructed, whether a test calls
the class or ``from_pretrained`` (which constructs through ``__init__`` too), through the public
``enable_trtllm_attention``. A test that later calls ``set_attn_processor`` / ``set_default_attn_processor``
gets what it asked for: that is what a user who calls them expects, and diffusers' tests of those methods check
exactly that, so the plugin does not put its processors back.

``--compile-tests-on-cpu`` lifts the "requires a hardware accelerator" skip from ``TorchCompileTesterMixin``
tests, which diffusers only runs on an accelerator, so graph breaks and recompiles show on a CPU machine too.
"""

from __future__ import annotations

import functools

#: the diffusers model classes this package has processors for.
MODEL_CLASSES = ("WanTransformer3DModel", "HunyuanVideo15Transformer3DModel", "Cosmos3OmniTransformer")

#: λ for ``reference-skip``: the README's example value.
SKIP_THRESHOLD = 0.5

#: ``--trtllm-processors`` value -> the ``AttentionConfig`` (as a dict) installed; None installs nothing.
MODES: dict[str, dict | None] = {
    "none": None,
    "sdpa": {"default": {"backend": "TORCH_SDPA"}},
    "reference-dense": {"default": {"backend": "TORCH_REFERENCE"}},
    "reference-skip": {"default": {"backend": "TORCH_REFERENCE", "skip_softmax": {"threshold": SKIP_THRESHOLD}}},
    "reference-sage": {"default": {"backend": "TORCH_REFERENCE", "quant": {"dtype_qk": "int8"}}},
}

ACCELERATOR_SKIP_REASON = "test requires a hardware accelerator"
COMPILE_MIXIN = "TorchCompileTesterMixin"


class InstallCount:
    """How many models got the processors since the patch went on (the report header and the harness test read it)."""

    def __init__(self) -> None:
        self.models = 0


def patch_model_construction(attention_config: dict) -> tuple[InstallCount, callable]:
    """Wrap ``__init__`` of every class in :data:`MODEL_CLASSES` so each new model gets the processors.

    Returns the install counter and a function that undoes the patch.
    """
    import diffusers

    from diffusers_trtllm import enable_trtllm_attention

    count = InstallCount()
    originals = {}
    for name in MODEL_CLASSES:
        cls = getattr(diffusers, name)
        original = cls.__init__

        @functools.wraps(original)  # keeps the signature ConfigMixin reads the config's keys from
        def init_then_install(self, *args, __original=original, __cls=cls, **kwargs):
            __original(self, *args, **kwargs)
            if type(self) is __cls:  # a subclass's own wrapper, if any, installs once its __init__ is complete
                enable_trtllm_attention(self, attention_config)
                count.models += 1

        cls.__init__ = init_then_install
        originals[cls] = original

    def unpatch() -> None:
        for cls, original in originals.items():
            cls.__init__ = original

    return count, unpatch


def pytest_addoption(parser):
    group = parser.getgroup("diffusers-trtllm")
    group.addoption("--trtllm-processors", choices=tuple(MODES), default="none",
                    help="this package's processors to install on every Wan / HunyuanVideo 1.5 / Cosmos 3 model the "
                         "tests construct (none = diffusers' own)")
    group.addoption("--compile-tests-on-cpu", action="store_true",
                    help=f"run {COMPILE_MIXIN} tests on a CPU (diffusers skips them without an accelerator)")


def pytest_configure(config):
    mode = config.getoption("--trtllm-processors")
    config._trtllm_install_count = None
    if MODES[mode] is not None:
        count, unpatch = patch_model_construction(MODES[mode])
        config._trtllm_install_count = count
        config.add_cleanup(unpatch)


def pytest_report_header(config):
    import diffusers

    mode = config.getoption("--trtllm-processors")
    return f"diffusers-trtllm processors: {mode} {MODES[mode]} on diffusers {diffusers.__version__}"


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--compile-tests-on-cpu"):
        return
    for item in items:
        if item.cls is None or COMPILE_MIXIN not in {base.__name__ for base in item.cls.__mro__}:
            continue
        for node in item.listchain():
            node.own_markers[:] = [mark for mark in node.own_markers if not _is_accelerator_skip(mark)]


def _is_accelerator_skip(mark) -> bool:
    return mark.name == "skipif" and mark.kwargs.get("reason") == ACCELERATOR_SKIP_REASON


def pytest_terminal_summary(terminalreporter, config):
    count = config._trtllm_install_count
    if count is not None:
        terminalreporter.write_line(f"diffusers-trtllm: processors installed on {count.models} models")
