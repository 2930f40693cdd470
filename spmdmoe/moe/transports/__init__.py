"""Transports: dispatch and combine (layer 5 of ``docs/design.md`` §0: imports routing and the layers below).

================  ===============================================================================
``dispatch.py``   the contract (``Transport``, ``SizedTransport``), the local and sync all-to-all
                  transports, ``transport_for``
``routed.py``     ``RoutedTokens`` (what every dispatch returns) and the fan-out to the local experts
``dedup.py``      a token once to each rank holding any of its experts, and its rows back
``sync_free.py``  sync-free EP over any backend: static capacity, device-side counts
``symmetric.py``  sync-free EP over NCCL on one host: rows read from the peers' symmetric buffers
================  ===============================================================================
"""
