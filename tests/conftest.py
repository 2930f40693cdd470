"""Shared pytest set-up.

``tests/distributed`` needs several processes, so plain ``pytest`` (no
``torchrun``) leaves it out; ``torchrun --nproc-per-node 4 -m pytest
tests/distributed`` runs it.

Without a GPU the Triton kernels of ``spmdmoe.kernels`` run under Triton's
interpreter (``TRITON_INTERPRET=1``, read when a kernel is defined, so it is
set here, before any test module imports spmdmoe): ``tests/test_kernels.py``
compares them with their references on CPU tensors.
"""

import os

import torch

collect_ignore = [] if "WORLD_SIZE" in os.environ else ["distributed"]

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
