"""Triton kernels with a plain-torch reference beside each (DESIGN.md §6).

Empty so far: the kernels (permute / un-permute, offset-aware SwiGLU, FP8
quantizers) arrive with the MoE and FP8 issues.
"""
