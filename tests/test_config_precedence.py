"""``per_role`` precedence, every pair of levels: the more specific key wins whichever order the keys are given in,
and a layer's qualified name beats its bare name, also through ``enable_trtllm_attention``."""

import itertools
import warnings

import pytest
import torch

from diffusers_trtllm import AttentionConfig, AttentionConfigError, enable_trtllm_attention

from helpers import tiny_wan, wan_inputs

SITE = ("transformer_2", "blocks.3.attn1", "self_attn", "self")
# the other call sites of a two-expert model, so every key below names something and each glob has a rank
SITES = [(component, f"blocks.{i}.attn{n}", role, category)
         for component in ("transformer", "transformer_2") for i in range(5)
         for n, role, category in ((1, "self_attn", "self"), (2, "cross_attn", "cross"))]
# the class docstring's order, most specific first; each key matches SITE
LEVELS = ["transformer_2.blocks.3.attn1",  # <component>.<layer>
          "blocks.3.attn1",                # <layer>
          "transformer_2.blocks.3.*",      # a glob (its layers: one component's block 3)
          "blocks.3.*",                    # a glob matching a strict superset of the one above
          "transformer_2.self_attn",       # <component>.<role>
          "transformer_2.self",            # <component>.<category>
          "self_attn",                     # role
          "self",                          # category
          "transformer_2"]                 # component


def spec_for(level: int) -> dict:
    """A spec that tells which level it came from: its threshold."""
    return {"backend": "TORCH_REFERENCE", "skip_softmax": {"threshold": (level + 1) / 100}}


@pytest.mark.parametrize("winner,loser", list(itertools.combinations(range(len(LEVELS)), 2)))
@pytest.mark.parametrize("order", [1, -1])
def test_the_more_specific_of_two_keys_wins_in_either_order(winner, loser, order):
    keys = [winner, loser][::order]
    config = AttentionConfig.from_dict({"default": {"backend": "TORCH_SDPA"},
                                        "per_role": {LEVELS[i]: spec_for(i) for i in keys}})
    key, spec = config.resolve_sites(SITES)[SITE]
    assert key == LEVELS[winner]
    assert spec.skip_softmax.threshold == spec_for(winner)["skip_softmax"]["threshold"]
    assert config.resolve(*SITE, sites=SITES)[0] == LEVELS[winner]


@pytest.mark.parametrize("level", range(len(LEVELS)))
def test_every_level_beats_the_default_and_a_key_of_another_site_does_not_apply(level):
    config = AttentionConfig.from_dict({"default": {"backend": "TORCH_SDPA"}, "per_role": {LEVELS[level]: spec_for(level)}})
    resolved = config.resolve_sites(SITES)
    assert resolved[SITE][0] == LEVELS[level]
    # transformer.blocks.0.attn2 (another component, block, role and category) matches none of the levels
    assert resolved[("transformer", "blocks.0.attn2", "cross_attn", "cross")] == ("default", config.default)


def test_component_role_beats_component_category_for_every_site_of_the_component():
    config = AttentionConfig.from_dict({"per_role": {"transformer.cross": spec_for(1),
                                                     "transformer.cross_attn": spec_for(0)}})
    resolved = config.resolve_sites(SITES)
    for site in SITES:
        expected = "transformer.cross_attn" if site[0] == "transformer" and site[3] == "cross" else "default"
        assert resolved[site][0] == expected


def test_a_glob_matches_the_bare_layer_name_too():
    """``blocks.3.*`` names no component: it matches block 3 of both transformers."""
    config = AttentionConfig.from_dict({"per_role": {"blocks.3.*": spec_for(0)}})
    resolved = config.resolve_sites(SITES)
    for component, n in itertools.product(("transformer", "transformer_2"), (1, 2)):
        assert resolved[(component, f"blocks.3.attn{n}", *SITES[n - 1][2:])][0] == "blocks.3.*"
        assert resolved[(component, f"blocks.1.attn{n}", *SITES[n - 1][2:])][0] == "default"


def test_a_glob_that_matches_no_layer_is_refused_and_one_that_matches_is_not():
    with pytest.raises(AttentionConfigError, match=r"'blocks.9.\*' matches no attention layer"):
        AttentionConfig.from_dict({"per_role": {"blocks.9.*": {}}}).resolve_sites(SITES)
    AttentionConfig.from_dict({"per_role": {"transformer_2.blocks.[34].*": {}}}).check_keys(SITES)


def test_overlapping_globs_rank_by_the_layers_they_match_over_the_model_not_by_key_order():
    """Over the model, blocks.3.attn[1] matches two layers, a strict subset of the ten *.attn1 matches: it is the
    more specific where both match. Without the model's other sites each matches this one layer: they tie."""
    config = AttentionConfig.from_dict({"per_role": {"*.attn1": spec_for(1), "blocks.3.attn[1]": spec_for(0)}})
    assert config.resolve(*SITE, sites=SITES)[0] == "blocks.3.attn[1]"
    assert config.resolve_sites(SITES)[("transformer", "blocks.4.attn1", "self_attn", "self")][0] == "*.attn1"
    with pytest.raises(AttentionConfigError,
                       match=r"'\*.attn1' and 'blocks.3.attn\[1\]' both match transformer_2.blocks.3.attn1"):
        config.resolve(*SITE)


def run_tiny_wan(config) -> dict:
    """Per-layer sparsity of one call of the tiny Wan transformer (192 tokens: 2 × 2 tiles per head)."""
    transformer = tiny_wan()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a threshold >= 1 warns: it skips every tile it may
        handle = enable_trtllm_attention(transformer, config)
    with handle, torch.no_grad():
        transformer(**wan_inputs(batch=1, frames=3))
        return handle.stats.per_layer()


def test_install_gives_a_layer_its_qualified_key_over_its_bare_name():
    """A bare layer key names the layer in every component; ``<component>.<layer>`` wins over it."""
    skip_all = {"backend": "TORCH_REFERENCE", "skip_softmax": {"threshold": 1e6}}
    dense = {"backend": "TORCH_REFERENCE"}
    per_layer = run_tiny_wan({"default": dense, "per_role": {"blocks.0.attn1": dense,
                                                             "transformer.blocks.0.attn1": skip_all}})
    # every KV tile after a query tile's first is skipped: 1 of 2
    assert per_layer["transformer.blocks.0.attn1"] == 0.5
    assert per_layer["transformer.blocks.1.attn1"] is None  # dense: no sparsity of its own
    per_layer = run_tiny_wan({"default": dense, "per_role": {"blocks.0.attn1": skip_all,
                                                             "transformer.blocks.0.attn1": dense}})
    assert per_layer["transformer.blocks.0.attn1"] is None
