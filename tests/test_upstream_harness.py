"""The plugin that runs diffusers' own model tests with this package's processors (tests/upstream/): it installs the
processors on every model the tests construct, each mode's config is valid, and it runs compile tests on a CPU."""

import sys
from pathlib import Path

import pytest
import torch
from diffusers import WanTransformer3DModel
from diffusers.models.transformers.transformer_wan import WanAttnProcessor

from diffusers_trtllm import WanTrtllmAttnProcessor

sys.path.insert(0, str(Path(__file__).resolve().parent / "upstream"))
import trtllm_processors_plugin as plugin  # noqa: E402

pytest_plugins = ["pytester"]

TINY_WAN = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
                text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", rope_max_seq_len=32)


def tiny_wan_call(model):
    inputs = dict(hidden_states=torch.randn(1, 4, 2, 16, 16), encoder_hidden_states=torch.randn(1, 12, 16),
                  timestep=torch.tensor([500]), return_dict=False)
    with torch.no_grad():
        return model(**inputs)[0]


def processor_types(model) -> set[type]:
    return {type(processor) for processor in model.attn_processors.values()}


@pytest.fixture
def patched():
    count, unpatch = plugin.patch_model_construction(plugin.MODES["sdpa"])
    yield count
    unpatch()


def test_models_built_by_init_and_from_pretrained_get_the_processors(patched, tmp_path):
    built = WanTransformer3DModel(**TINY_WAN)
    assert processor_types(built) == {WanTrtllmAttnProcessor}
    built.save_pretrained(tmp_path)
    loaded = WanTransformer3DModel.from_pretrained(tmp_path)
    assert processor_types(loaded) == {WanTrtllmAttnProcessor}
    assert patched.models == 2


def test_after_unpatch_models_keep_diffusers_processors():
    count, unpatch = plugin.patch_model_construction(plugin.MODES["sdpa"])
    unpatch()
    assert processor_types(WanTransformer3DModel(**TINY_WAN)) == {WanAttnProcessor}
    assert count.models == 0


def test_explicit_set_attn_processor_is_left_as_the_test_set_it(patched):
    model = WanTransformer3DModel(**TINY_WAN)
    model.set_attn_processor(WanAttnProcessor())
    assert processor_types(model) == {WanAttnProcessor}


@pytest.mark.parametrize("mode", [mode for mode, config in plugin.MODES.items() if config is not None])
def test_every_mode_installs_and_runs(mode):
    torch.manual_seed(0)
    reference = tiny_wan_call(WanTransformer3DModel(**TINY_WAN))
    count, unpatch = plugin.patch_model_construction(plugin.MODES[mode])
    try:
        torch.manual_seed(0)
        model = WanTransformer3DModel(**TINY_WAN)
    finally:
        unpatch()
    assert processor_types(model) == {WanTrtllmAttnProcessor}
    out = tiny_wan_call(model)
    # dense modes equal diffusers' output; skip and SAGE approximate it (one 128-key tile here: skip keeps it)
    tolerance = 0.1 if mode == "reference-sage" else 1e-5
    assert (out - reference).abs().max() <= tolerance * reference.abs().max()


COMPILE_TESTS = '''
import pytest

@pytest.mark.skipif(True, reason="test requires a hardware accelerator")
class TorchCompileTesterMixin:
    def test_compiles(self):
        pass

@pytest.mark.skipif(True, reason="test requires a hardware accelerator")
class MemoryTesterMixin:
    def test_offloads(self):
        pass

class TestModelCompile(TorchCompileTesterMixin):
    pass

class TestModelMemory(MemoryTesterMixin):
    pass
'''


@pytest.mark.parametrize("flag, passed, skipped", [(True, 1, 1), (False, 0, 2)])
def test_compile_tests_on_cpu_lifts_only_the_compile_mixins_accelerator_skip(pytester, flag, passed, skipped):
    pytester.makepyfile(test_mixins=COMPILE_TESTS)
    args = ["-p", "trtllm_processors_plugin"] + (["--compile-tests-on-cpu"] if flag else [])
    result = pytester.runpytest_inprocess(*args)
    result.assert_outcomes(passed=passed, skipped=skipped)


def test_unknown_mode_is_refused_with_the_valid_ones(pytester):
    pytester.makepyfile(test_nothing="def test_nothing():\n    pass\n")
    result = pytester.runpytest_inprocess("-p", "trtllm_processors_plugin", "--trtllm-processors", "dense")
    assert result.ret != 0
    result.stderr.fnmatch_lines(["*--trtllm-processors*invalid choice*'dense'*"])
