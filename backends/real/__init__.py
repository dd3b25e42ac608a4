"""The real execution backend: the simulator's own batches run through a Llama/Qwen-style
decoder (dense, or Qwen3-MoE/Mixtral experts: moe.py) with a paged KV cache (torch, Triton kernels
on a GPU) and measured step by step.

Importing it needs torch; without it the import raises a `ServesimError` naming the pip extra.
"""

from backends.real.backend import RealBackend

__all__ = ["RealBackend"]
