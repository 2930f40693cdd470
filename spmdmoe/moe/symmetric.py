"""The public home of the symmetric EP transport's selective-checkpointing policy, ``spmdmoe.moe.symmetric``
(docs/guide.md, public API): under ``torch.compile`` with activation checkpointing, it saves the transport's moves. Its code, with the
transport, is ``transports/symmetric.py``.

>>> from spmdmoe.moe.symmetric import checkpoint_policy
"""

from .transports.symmetric import checkpoint_policy

__all__ = ["checkpoint_policy"]
