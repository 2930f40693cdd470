"""The state-dict conversions' public home, ``spmdmoe.moe.checkpoint`` (README, docs/torchtitan.md): torchtitan
0.3.0's names in and out. Their code, with the layers' state-dict hooks, is ``params/checkpoint.py``.

>>> from spmdmoe.moe.checkpoint import from_torchtitan, to_torchtitan
"""

from .params.checkpoint import from_torchtitan, to_torchtitan

__all__ = ["from_torchtitan", "to_torchtitan"]
