"""Timing a pipeline's transformer calls (:class:`TransformerTimer`) and device synchronisation."""

from __future__ import annotations

import time
from typing import Mapping

import torch

from diffusers_trtllm.install import pipeline_transformers


class TransformerTimer:
    """Times every forward call of the given transformers (a pipeline's ``transformer`` and ``transformer_2``)
    with forward hooks: CUDA events on a GPU (no synchronisation inside the denoising loop), wall clock on a CPU.
    Use as a context manager; :meth:`seconds` lists each call's duration."""

    def __init__(self, modules: Mapping[str, torch.nn.Module]):
        self.modules = dict(modules)
        self._marks: list[list] = []  # [on CUDA, start, end] per call
        self._hooks: list = []

    @classmethod
    def for_pipeline(cls, pipe) -> "TransformerTimer":
        return cls(pipeline_transformers(pipe))

    @staticmethod
    def _on_cuda(module: torch.nn.Module) -> bool:
        param = next(module.parameters(), None)
        return param is not None and param.is_cuda

    def _mark(self, cuda: bool):
        if cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def __enter__(self) -> "TransformerTimer":
        for module in self.modules.values():
            cuda = self._on_cuda(module)
            self._hooks.append(module.register_forward_pre_hook(
                lambda *_, cuda=cuda: self._marks.append([cuda, self._mark(cuda), None])))
            self._hooks.append(module.register_forward_hook(
                lambda *_, cuda=cuda: self._marks[-1].__setitem__(2, self._mark(cuda))))
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def seconds(self) -> list[float]:
        if any(cuda for cuda, _, _ in self._marks):
            torch.cuda.synchronize()
        return [start.elapsed_time(end) / 1e3 if cuda else end - start for cuda, start, end in self._marks]

    @property
    def total(self) -> float:
        return sum(self.seconds())


def synchronize(device: str | torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
