"""Video metrics: PSNR, SSIM (here, in torch) and LPIPS (AlexNet, from the ``lpips`` package when it can load;
imported inside :class:`LpipsScorer`)."""

from __future__ import annotations

import math

import torch


def psnr(video: torch.Tensor, reference: torch.Tensor) -> float:
    """Peak signal-to-noise ratio in dB of values in [0, 1]; inf for identical videos."""
    mse = torch.mean((video.double() - reference.double()) ** 2).item()
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def ssim(video: torch.Tensor, reference: torch.Tensor, window: int = 11, sigma: float = 1.5) -> float:
    """Mean structural similarity (Wang et al. 2004: Gaussian window 11, σ 1.5, K1 0.01, K2 0.03, range 1) over
    frames and channels of ``[frames, C, H, W]`` videos in [0, 1]. Frames smaller than the window use a window
    of their size."""
    x, y = video.float(), reference.float()
    window = min(window, x.shape[-1], x.shape[-2])
    coords = torch.arange(window, dtype=torch.float32) - (window - 1) / 2
    g = torch.exp(-coords ** 2 / (2 * sigma ** 2))
    g = g / g.sum()
    height, width = x.shape[-2:]

    def band(size: int) -> torch.Tensor:  # valid 1-D convolution with g as a [size - window + 1, size] matrix
        m = torch.zeros(size - window + 1, size)
        for i in range(size - window + 1):
            m[i, i:i + window] = g
        return m

    rows, cols = band(height), band(width).T

    def blur(t):  # the Gaussian is separable: two 1-D passes, as matrix products
        return rows @ t @ cols

    c1, c2 = 0.01 ** 2, 0.03 ** 2
    mx, my = blur(x), blur(y)
    vx, vy, cxy = blur(x * x) - mx ** 2, blur(y * y) - my ** 2, blur(x * y) - mx * my
    s = ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx ** 2 + my ** 2 + c1) * (vx + vy + c2))
    return s.double().mean().item()


class LpipsScorer:
    """LPIPS with AlexNet features (the ``lpips`` package). Its weights come from torchvision's download at first
    use; where that fails (offline, or torchvision unusable), :attr:`unavailable` says why and :meth:`score`
    returns None."""

    def __init__(self, device: str = "cpu", batch_frames: int = 8):
        self.device = device
        self.batch_frames = batch_frames
        self.unavailable: str | None = None
        self._model = None
        try:
            import lpips

            self._model = lpips.LPIPS(net="alex", verbose=False).to(device).eval()
        except Exception as e:  # noqa: BLE001  (import, download and load failures all mean: no LPIPS)
            self.unavailable = (f"LPIPS (AlexNet) could not be loaded: {type(e).__name__}: {str(e).splitlines()[0]} "
                                "(optional: pip install lpips with a torchvision built for this torch, and the "
                                "AlexNet weights downloadable or cached)")

    @torch.no_grad()
    def score(self, video: torch.Tensor, reference: torch.Tensor) -> float | None:
        """Mean per-frame LPIPS of ``[frames, C, H, W]`` videos in [0, 1]."""
        if self._model is None:
            return None
        total = 0.0
        for i in range(0, video.shape[0], self.batch_frames):
            a, b = (t[i:i + self.batch_frames].to(self.device) * 2 - 1 for t in (video, reference))
            total += self._model(a, b).sum().item()
        return total / video.shape[0]
