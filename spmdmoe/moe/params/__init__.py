"""Parameters (layer 4 of ``docs/design.md`` §0: imports the config and the layers below it only).

=================  ==============================================================================
``init.py``        the truncated-normal init, the same weights on one device and on any shard layout
``checkpoint.py``  the state-dict layout: torchtitan names, experts as global DTensors, load agreement
``grads.py``       the SP gradient sums (``sync_grads``, ``replicate_grads``) and the batch reductions
``overlap.py``     those sums launched at their use and waited for at a join (``overlap_grads``)
``flat.py``        one buffer per dtype for a bucket of gradients
=================  ==============================================================================
"""
