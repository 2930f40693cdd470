"""Routing (layer 4 of ``docs/design.md`` §0: imports the config and the layers below it only).

==============  =================================================================================
``router.py``   the gate, scores and top-k choice on ``scores + expert_bias`` (``Router``, ``route``)
``permute.py``  counts per expert, the stable permutation into expert-major order and back
``balance.py``  load counts (added by the backward), the bias update, the aux loss
==============  =================================================================================
"""
