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
