"""The edges a user meets first, through the public API and the scripts as users run them: environment switches
read one way, what the statistics' numbers mean."""

import pytest
import torch

from diffusers_trtllm import AttentionConfigError, config_from_args, enable_trtllm_attention
from diffusers_trtllm.backends.base import TRTLLM_ON_REFERENCE_ENV
from diffusers_trtllm.config import env_switch

from helpers import tiny_wan, wan_inputs

SWITCHES = [TRTLLM_ON_REFERENCE_ENV, "TRTLLM_GEN_SAGE", "DIFFUSERS_TRTLLM_COLLECT_STATS"]


@pytest.mark.parametrize("raw, on", [("1", True), ("true", True), ("TRUE", True), (" yes ", True), ("on", True),
                                     ("0", False), ("false", False), ("No", False), ("off", False), ("", False)])
def test_every_switch_reads_the_same_words(raw, on):
    for name in SWITCHES:
        assert env_switch(name, {name: raw}) is on, name
    assert env_switch("UNSET", {}) is False


@pytest.mark.parametrize("name", SWITCHES)
def test_a_switch_value_it_does_not_know_is_refused_naming_the_variable(name):
    with pytest.raises(AttentionConfigError) as refused:
        env_switch(name, {name: "maybe"})
    assert str(refused.value) == (f"{name}='maybe' is invalid: expected one of ['1', 'true', 'yes', 'on', '0', "
                                  "'false', 'no', 'off'] (or empty)")


def test_the_reference_seam_takes_true(monkeypatch):
    """``DIFFUSERS_TRTLLM_TRTLLM_ATTN_ON_REFERENCE=true`` runs TRTLLM_ATTN on the reference, as ``1`` does."""
    monkeypatch.setenv(TRTLLM_ON_REFERENCE_ENV, "true")
    model = tiny_wan()
    with enable_trtllm_attention(model, {"default": {"backend": "TRTLLM_ATTN"}}) as handle, torch.no_grad():
        model(**wan_inputs(batch=1, frames=1, height=8, width=8))
        assert {rec.backend for rec in handle.stats.records.values()} == {"TRTLLM_ATTN"}


def test_the_sage_shortcut_variable_takes_the_same_words():
    assert config_from_args(None, {"TRTLLM_GEN_SAGE": "yes"}).default.quant.dtype_qk == "fp8_e4m3"
    assert config_from_args(None, {"TRTLLM_GEN_SAGE": "off"}).default.quant is None
