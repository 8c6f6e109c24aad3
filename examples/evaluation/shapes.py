"""Which video sizes and frame counts a model takes (:class:`ShapeRule`), checked by every example before any
model is built.

What a pipeline does with a shape it cannot take is no help to a user: Wan raises from its input check (a
diffusers traceback) for a size its VAE and patches do not divide, HunyuanVideo 1.5 rounds such a size down
without a word, and all three round a frame count that the VAE's temporal compression does not fit (Wan with a
logged warning, the others silently). The examples refuse such a shape instead, naming the nearest that work.
:func:`shape_rule_of` derives the rule from a built pipeline (its VAE's scale factors and its transformer's patch
size); the model table in :mod:`.models` states it per model so that it can be checked before loading, and the
tests pin the two equal.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ShapeRule:
    """Height and width must be multiples of ``vae_spatial × patch_spatial`` (the VAE's spatial compression
    times the transformer's patch, so every latent patch is whole); frames must be ``1 + k × frame_stride``
    (the causal VAE keeps the first frame alone and compresses the rest ``vae_temporal × patch_temporal`` to
    one)."""

    vae_spatial: int
    patch_spatial: int
    vae_temporal: int
    patch_temporal: int = 1

    @property
    def size_multiple(self) -> int:
        return self.vae_spatial * self.patch_spatial

    @property
    def frame_stride(self) -> int:
        return self.vae_temporal * self.patch_temporal

    def problem(self, model: str, height: int | None, width: int | None, frames: int | None) -> str | None:
        """Why ``model`` cannot take this shape (one line naming the option, the value and what works), or None;
        ``None`` values are the pipeline's defaults and are not checked."""
        m = self.size_multiple
        for option, value in (("--height", height), ("--width", width)):
            if value is not None and value % m:
                below, above = value // m * m, (value // m + 1) * m
                nearest = f"{below} or {above}" if below else f"{above}"
                return (f"{option} {value} is invalid for {model}: expected a multiple of {m} (VAE compression "
                        f"{self.vae_spatial} × patch {self.patch_spatial}), e.g. {nearest}")
        s = self.frame_stride
        if frames is not None and (frames - 1) % s:
            below, above = (frames - 1) // s * s + 1, ((frames - 1) // s + 1) * s + 1
            return (f"--frames {frames} is invalid for {model}: expected 1 + a multiple of {s} (the VAE keeps the "
                    f"first frame and compresses every {s} after it into one), e.g. {below} or {above}")
        return None


def shape_rule_of(pipe) -> ShapeRule:
    """The rule of a built pipeline: its VAE's scale factors (``pipe.vae_scale_factor_spatial`` /
    ``_temporal``) and its transformer's patch size (Wan: ``patch_size`` (t, h, w); HunyuanVideo 1.5:
    ``patch_size`` and ``patch_size_t``). Cosmos 3's pipeline pads a partial latent patch itself, so only its VAE's
    factor binds there."""
    config = (pipe.transformer or pipe.transformer_2).config
    if "latent_patch_size" in config:
        patch_t, patch_s = 1, 1
    elif isinstance(config["patch_size"], (tuple, list)):
        patch_t, patch_s, patch_w = config["patch_size"]
        if patch_w != patch_s:
            raise ValueError(f"patch_size={tuple(config['patch_size'])}: unequal height and width patches")
    else:
        patch_t, patch_s = config.get("patch_size_t", 1), config["patch_size"]
    return ShapeRule(int(pipe.vae_scale_factor_spatial), int(patch_s), int(pipe.vae_scale_factor_temporal),
                     int(patch_t))
