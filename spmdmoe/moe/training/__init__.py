"""Training interop over models of parallel layers (layer 9 of ``docs/design.md`` §0: imports the parallel
layer and everything below it).

====================  ===========================================================================
``data_parallel.py``  ``grad_reductions``, ``reduce_grads``, ``ddp``: the batch reductions applied
``fsdp.py``           ``fully_shard_moe``, ``register_spmd_hooks``: FSDP2 units on the right groups
``clip.py``           ``clip_grad_norm_`` over every axis, one all-reduce
====================  ===========================================================================
"""
