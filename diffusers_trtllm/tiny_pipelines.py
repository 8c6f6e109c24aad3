"""Tiny randomly initialised pipelines: the demo's default model and the tests' fixtures. No downloads.

They are real diffusers pipelines (real schedulers, VAEs, text encoders and transformers) shrunk to a few
layers and channels, so the whole path from prompt to video runs on a CPU in seconds.
"""

from __future__ import annotations

import torch

TINY_TEXT_DIM = 32
TINY_TEXT_LEN = 512  # Wan's processor assumes 512 text tokens


def byte_tokenizer(model_max_length: int = TINY_TEXT_LEN):
    """A character-level fast tokenizer built in code (vocabulary: the 256 Latin-1 characters + pad, eos, unk),
    so no files are fetched."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(i): i for i in range(256)}
    vocab.update({"<pad>": 256, "</s>": 257, "<unk>": 258})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   model_max_length=model_max_length)


def tiny_umt5(seed: int = 0):
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    config = UMT5Config(vocab_size=259, d_model=TINY_TEXT_DIM, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                        relative_attention_num_buckets=8, pad_token_id=256, eos_token_id=257)
    return UMT5EncoderModel(config).eval()


def tiny_wan_transformer(seed: int = 0, *, image_dim: int | None = None, qk_gain: float = 1.0, **overrides):
    """A 2-layer ``WanTransformer3DModel`` (2 heads of 16 channels). ``image_dim`` adds Wan 2.1 I2V image
    cross-attention. ``qk_gain`` != 1 gives self-attention the locality of trained video models, so Skip-Softmax
    has something to skip: K shares Q's projection (each token then scores itself and, through RoPE, its
    neighbours highest) and the Q/K norm weights are multiplied by ``qk_gain``."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    config = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=16,
                  out_channels=16, text_dim=TINY_TEXT_DIM, freq_dim=32, ffn_dim=64, num_layers=2,
                  cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=64,
                  image_dim=image_dim)
    config.update(overrides)
    model = WanTransformer3DModel(**config).eval()
    if qk_gain != 1.0:
        with torch.no_grad():
            for block in model.blocks:
                block.attn1.to_k.weight.copy_(block.attn1.to_q.weight)
                block.attn1.to_k.bias.copy_(block.attn1.to_q.bias)
                block.attn1.norm_k.weight.copy_(block.attn1.norm_q.weight)
                block.attn1.norm_q.weight.mul_(qk_gain)
                block.attn1.norm_k.weight.mul_(qk_gain)
    return model


def tiny_wan_vae(seed: int = 0):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    return AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                            temperal_downsample=[False, True, True]).eval()


def tiny_wan22_pipeline(seed: int = 0, *, two_experts: bool = True, qk_gain: float = 4.0):
    """A Wan 2.2 A14B-shaped text-to-video pipeline: two experts switching at t = 0.875 (``boundary_ratio``),
    UniPC with flow shift 3 as in the real model, tiny UMT5 and VAE."""
    from diffusers import UniPCMultistepScheduler, WanPipeline

    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        num_train_timesteps=1000, flow_shift=3.0)
    return WanPipeline(
        tokenizer=byte_tokenizer(), text_encoder=tiny_umt5(seed), vae=tiny_wan_vae(seed), scheduler=scheduler,
        transformer=tiny_wan_transformer(seed, qk_gain=qk_gain),
        transformer_2=tiny_wan_transformer(seed + 1, qk_gain=qk_gain) if two_experts else None,
        boundary_ratio=0.875 if two_experts else None)


CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}\n{% endfor %}"


def chat_byte_tokenizer(model_max_length: int, special_tokens: tuple[str, ...] = ()):
    """:func:`byte_tokenizer` with a plain chat template (one message per line) and extra special tokens, for
    pipelines that tokenize through ``apply_chat_template``."""
    tok = byte_tokenizer(model_max_length)
    if special_tokens:
        tok.add_special_tokens({"additional_special_tokens": list(special_tokens)})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _share_query_key(q_proj, k_proj, q_norm, k_norm, head_dim: int, qk_gain: float) -> None:
    """Give random attention the locality of trained video models, so Skip-Softmax has tiles to skip: each query
    head takes its key head's projection and norm (each token then scores itself and, through RoPE, its neighbours
    highest; grouped-query heads share their group's key head) and both norm weights grow by ``qk_gain``."""
    group = q_proj.out_features // k_proj.out_features
    with torch.no_grad():
        for name in ("weight", "bias"):
            k_param = getattr(k_proj, name)
            if k_param is not None:
                per_head = k_param.unflatten(0, (-1, head_dim)).repeat_interleave(group, dim=0)
                getattr(q_proj, name).copy_(per_head.flatten(0, 1))
        q_norm.weight.copy_(k_norm.weight)
        q_norm.weight.mul_(qk_gain)
        k_norm.weight.mul_(qk_gain)


HUNYUAN15_TINY_LATENT_CHANNELS = 4
# HunyuanVideo15Pipeline crops this many tokens off the front of the chat (prompt_template_encode_start_idx): the
# system turn as the real Qwen2.5-VL tokenizer encodes it.
HUNYUAN15_SYSTEM_TOKENS = 108
# The character tokenizer renders the system turn as exactly those tokens (its first 107 characters, padded, and a
# newline), so the crop leaves the user's prompt, as in the real model. The template is saved with the tokenizer,
# so a pipeline saved and loaded by path encodes prompts alike.
HUNYUAN15_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    f"{{{{ (message['content'] ~ ' ' * {HUNYUAN15_SYSTEM_TOKENS})[:{HUNYUAN15_SYSTEM_TOKENS - 1}] }}}}\n"
    "{% else %}{{ message['content'] }}\n{% endif %}{% endfor %}")


def tiny_hunyuan_video15_transformer(seed: int = 0, *, qk_gain: float = 1.0, **overrides):
    """A 2-block ``HunyuanVideo15Transformer3DModel`` (2 heads of 16 channels, 1 refiner block) for the tiny
    pipeline's latents. ``qk_gain`` != 1 makes joint attention local and peaky (see :func:`_share_query_key`)."""
    from diffusers import HunyuanVideo15Transformer3DModel

    torch.manual_seed(seed)
    config = dict(in_channels=2 * HUNYUAN15_TINY_LATENT_CHANNELS + 1, out_channels=HUNYUAN15_TINY_LATENT_CHANNELS,
                  num_attention_heads=2, attention_head_dim=16, num_layers=2, num_refiner_layers=1,
                  text_embed_dim=TINY_TEXT_DIM, text_embed_2_dim=16, image_embed_dim=8, rope_axes_dim=(4, 6, 6),
                  target_size=64, task_type="t2v")
    config.update(overrides)
    model = HunyuanVideo15Transformer3DModel(**config).eval()
    if qk_gain != 1.0:
        for block in model.transformer_blocks:
            attn, head_dim = block.attn, config["attention_head_dim"]
            _share_query_key(attn.to_q, attn.to_k, attn.norm_q, attn.norm_k, head_dim, qk_gain)
            _share_query_key(attn.add_q_proj, attn.add_k_proj, attn.norm_added_q, attn.norm_added_k, head_dim, qk_gain)
    return model


def tiny_hunyuan_video15_pipeline(seed: int = 0, *, qk_gain: float = 4.0):
    """A HunyuanVideo 1.5 text-to-video pipeline built in code: tiny Qwen2.5-VL text model behind a character
    tokenizer with a chat template (Qwen2Tokenizer's vocabulary would need a download), ByT5 tokenizer (built
    without files) with a tiny T5 encoder, tiny VAE (16× spatial, 4× temporal), flow-matching Euler with shift 7
    (the 720p setting), CFG guider. The text paths keep the pipeline's own lengths (1000 MLLM, 256 ByT5 and 729
    image tokens, the real model's): the pipeline sets them in ``__init__`` and saves none of them, so only these
    survive ``save_pretrained`` / ``from_pretrained``. Attention sees the valid tokens only: the prompt's
    characters (the chat template's system turn is what the pipeline crops); a prompt without quoted glyph text
    has no ByT5 tokens, and text-to-video no image tokens.
    The VAE decodes one video at a time (diffusers 0.42.1's HunyuanVideo 1.5 VAE attention breaks for batch > 1;
    use ``output_type="latent"`` for batches)."""
    from diffusers import AutoencoderKLHunyuanVideo15, FlowMatchEulerDiscreteScheduler, HunyuanVideo15Pipeline
    from diffusers.guiders import ClassifierFreeGuidance
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    # The pipeline reads hidden_states[-3], so the text model needs at least 3 layers.
    text_encoder = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
        vocab_size=259, hidden_size=TINY_TEXT_DIM, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}, pad_token_id=256)).eval()
    text_encoder_2 = T5EncoderModel(T5Config(vocab_size=384, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                                             relative_attention_num_buckets=8)).eval()
    vae = AutoencoderKLHunyuanVideo15(latent_channels=HUNYUAN15_TINY_LATENT_CHANNELS,
                                      block_out_channels=(8, 8, 8, 8, 8), layers_per_block=1).eval()
    tokenizer = byte_tokenizer(4096)
    tokenizer.chat_template = HUNYUAN15_CHAT_TEMPLATE
    return HunyuanVideo15Pipeline(
        text_encoder=text_encoder, tokenizer=tokenizer, text_encoder_2=text_encoder_2,
        tokenizer_2=ByT5Tokenizer(), vae=vae, transformer=tiny_hunyuan_video15_transformer(seed, qk_gain=qk_gain),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0), guider=ClassifierFreeGuidance(guidance_scale=6.0))


COSMOS3_TINY_LATENT_CHANNELS = 16  # the tiny Wan VAE's z_dim


def tiny_cosmos3_transformer(seed: int = 0, *, vocab_size: int = 260, qk_gain: float = 1.0, **overrides):
    """A 2-layer ``Cosmos3OmniTransformer`` with grouped-query heads (4 query / 2 key-value heads of 16 channels).
    ``qk_gain`` != 1 makes both streams' attention local and peaky (see :func:`_share_query_key`)."""
    from diffusers import Cosmos3OmniTransformer

    torch.manual_seed(seed)
    config = dict(head_dim=16, hidden_size=64, intermediate_size=128, latent_channel=COSMOS3_TINY_LATENT_CHANNELS,
                  num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                  patch_latent_dim=COSMOS3_TINY_LATENT_CHANNELS * 4, vocab_size=vocab_size, rope_axes_dim=(4, 2, 2),
                  dtype="float32")
    config.update(overrides)
    model = Cosmos3OmniTransformer(**config).eval()
    if qk_gain != 1.0:
        for layer in model.layers:
            attn = layer.self_attn
            _share_query_key(attn.to_q, attn.to_k, attn.norm_q, attn.norm_k, attn.head_dim, qk_gain)
            _share_query_key(attn.add_q_proj, attn.add_k_proj, attn.norm_added_q, attn.norm_added_k, attn.head_dim,
                             qk_gain)
    return model


def tiny_cosmos3_pipeline(seed: int = 0, *, qk_gain: float = 4.0):
    """A Cosmos 3 Omni text-to-video pipeline built in code: character tokenizer with ``<|vision_start|>`` and a
    chat template, tiny Wan VAE, UniPC with flow shift 3, no safety checker (it needs the cosmos_guardrail
    package and its weights) and no system prompt (it only lengthens the causal text stream)."""
    from diffusers import UniPCMultistepScheduler
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import Cosmos3OmniPipeline

    tokenizer = chat_byte_tokenizer(4096, special_tokens=("<|vision_start|>",))
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        num_train_timesteps=1000, flow_shift=3.0)
    return Cosmos3OmniPipeline(
        transformer=tiny_cosmos3_transformer(seed, vocab_size=len(tokenizer), qk_gain=qk_gain),
        text_tokenizer=tokenizer, vae=tiny_wan_vae(seed), scheduler=scheduler, enable_safety_checker=False,
        default_use_system_prompt=False)
