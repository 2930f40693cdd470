"""torchtitan's own ``parallelize`` (EP = 4) on a swapped model, in 4 fresh processes (gloo, CPU).

Run by ``tests/test_torchtitan.py::test_torchtitans_parallelize_ep4`` through ``torchrun --standalone
--nproc-per-node 4``: in processes of its own, because torchtitan's meshes and spmd state are global.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_docs_torchtitan import guide_blocks  # noqa: E402
from torchtitan_models import build, debug_config  # noqa: E402

from spmdmoe.integrations.torchtitan import SwappedMoE  # noqa: E402


def main():
    """torchtitan's own ``parallelize_deepseekv3`` (EP = 4 over dp_shard = 4, FSDP, ``partial_dtensor``
    backend) on the swapped model, called as torchtitan's Trainer calls it: the ``parallelize_fn`` of the
    spec that ``docs/torchtitan.md``'s Trainer block makes (it swaps, then parallelizes): each rank trains its own batch; the reference is the unparallelized
    torchtitan model with the same weights on all 4 batches (loss: their sum: torchtitan turns FSDP's division off and
    normalises the loss itself).

    Two accommodations, both for gloo, neither in spmdmoe: torchtitan picks the "cuda" device type when
    no accelerator is present (set to "cpu" before its meshes are built), and FSDP2 reduces gradients
    with ``PREMUL_SUM`` / ``AVG``, which gloo lacks (``set_force_sum_reduction_for_comms``). torchtitan's
    own MoE cannot be the parallel reference here: its EP all-to-all fails on gloo (uneven
    ``alltoall`` splits are refused). Tolerances: loss within 1 %; each gradient ||diff|| / ||ref|| <= 2e-2
    (bf16 experts on both sides; the router gate's gradient, a sum over every token of its experts' bf16
    outputs, differs by 1.06e-2 here)."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config

    parallel_dims_module.device_type = "cpu"
    dims = parallel_dims_module.ParallelDims(dp_replicate=1, dp_shard=4, cp=1, tp=1, pp=1, ep=4, world_size=4,
                                             spmd_backend="partial_dtensor")
    dims.build_mesh()
    config = debug_config()
    ref = build(copy.deepcopy(config))
    set_deepseek_v3_sharding_config(config, enable_sp=False, enable_ep=True)
    with torch.device("meta"):
        model = config.build()
    guide: dict = {}
    exec(guide_blocks()[0], guide)  # model_spec = swapped_model_spec(model_registry("debugmodel"))
    parallelism = ParallelismConfig(expert_parallel_degree=4, data_parallel_shard_degree=4,
                                    spmd_backend="partial_dtensor")
    model = guide["model_spec"].parallelize_fn(model, parallel_dims=dims, training=TrainingConfig(),
                                               parallelism=parallelism, compile_config=CompileConfig(),
                                               ac_config=None, dump_folder="")
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_states(buffer_device=torch.device("cpu"))
        for (name, a), (_, b) in zip(ref.named_parameters(), model.named_parameters()):
            a.copy_(b.full_tensor() if isinstance(b, DTensor) else b)
    assert isinstance(model.layers["1"].moe, SwappedMoE)
    tokens = torch.randint(0, 2048, (4, 2, 17), generator=torch.Generator().manual_seed(13))
    rank = dist.get_rank()

    def loss_of(m, t):
        logits = m(t[:, :-1])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), t[:, 1:].flatten())

    loss = loss_of(model, tokens[rank])
    loss.backward()
    ref_losses = [loss_of(ref, tokens[r]) for r in range(4)]
    torch.stack(ref_losses).sum().backward()
    assert abs(loss.item() - ref_losses[rank].item()) <= 0.01 * ref_losses[rank].item()
    for (name, a), (_, b) in zip(ref.named_parameters(), model.named_parameters()):
        grad = b.grad.full_tensor() if isinstance(b.grad, DTensor) else b.grad
        assert (a.grad - grad).norm() <= 2e-2 * a.grad.norm(), (name, float((a.grad - grad).norm() / a.grad.norm()))
    print(f"rank {rank}: loss {loss.item():.6f} (reference {ref_losses[rank].item():.6f}), gradients match")


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        main()
    finally:
        dist.destroy_process_group()
