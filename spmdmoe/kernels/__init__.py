"""Triton kernels with a plain-torch reference beside each (docs/design.md §7).

Empty so far: the kernels (permute / un-permute, offset-aware SwiGLU, FP8
quantizers) arrive with the MoE and FP8 issues.
"""
