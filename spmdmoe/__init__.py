"""spmdmoe: sequence- and expert-parallel Mixture-of-Experts with exact token counts.

Tensors carry their layout on one mesh axis (:class:`SPMDTensor`): placement
and the global token count, so no code path infers a global shape from a local
shard. See ``docs/design.md`` for the chunk rule, the collectives and the
agreement mechanism.
"""

from typing import Any

from . import types
from . import agreement, collectives, moe, testing
from .sticky import check_errors
from .moe.training.clip import clip_grad_norm_
from .collectives import all_gather, all_reduce, all_to_all, exchange_counts, redistribute, reduce_scatter
from .construct import from_local, padded_empty, shard
from .meshes import init_mesh, product_axis
from .moe.transports.routed import RoutedTokens
from .shutdown import shutdown
from .types import *  # noqa: F401,F403
from .types import __all__ as _types_all

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """``spmdmoe.dtensor`` (the DTensor adapter) is imported at its first use: DTensor costs every process about
    1 s of import on a 2-core CPU, and a program that makes no DTensor need not pay it."""
    if name == "dtensor":
        import importlib

        return importlib.import_module(".dtensor", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "agreement",
    "check_errors",
    "clip_grad_norm_",
    "collectives",
    "dtensor",
    "moe",
    "testing",
    "types",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "exchange_counts",
    "redistribute",
    "reduce_scatter",
    "shutdown",
    "from_local",
    "padded_empty",
    "shard",
    "init_mesh",
    "product_axis",
    "RoutedTokens",
    *_types_all,
]
