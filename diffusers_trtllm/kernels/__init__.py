"""Attention kernels and the calls into them: FlashInfer bindings and the project's own Triton kernels."""
