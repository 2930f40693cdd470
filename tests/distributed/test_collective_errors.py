"""Bad inputs to collectives raise specific errors on every rank (within the test timeout), in the default mode
and in the collective-checking mode (``spmdmoe.set_checks("collectives")``)."""

import pytest
import torch

import spmdmoe
from spmdmoe import Partial, Replicate, Shard, SPMDLayoutError, SPMDMeshError, SPMDTensor, Varying
from spmdmoe.testing import assert_raises_everywhere

pytestmark = pytest.mark.one_rank_bad  # fresh process groups, 30 s timeout (conftest.py)


@pytest.fixture(params=[True, "collectives"], ids=["default", "collectives"], autouse=True)
def checks_mode(request):
    previous = spmdmoe.set_checks(request.param)
    yield request.param
    spmdmoe.set_checks(previous)


def test_placement_not_allowed(world, device):
    x = spmdmoe.shard(torch.zeros(5, 2, device=device), world)
    rep = spmdmoe.all_gather(x)
    assert_raises_everywhere(SPMDLayoutError, lambda: spmdmoe.all_gather(rep), match="all_gather takes a Shard tensor, found Replicate")
    assert_raises_everywhere(SPMDLayoutError, lambda: spmdmoe.reduce_scatter(x), match="takes a Partial tensor")
    assert_raises_everywhere(SPMDLayoutError, lambda: spmdmoe.all_reduce(rep), match="takes a Partial tensor")
    assert_raises_everywhere(SPMDLayoutError, lambda: spmdmoe.all_to_all(x, [0]), match="takes a Varying tensor")
    assert_raises_everywhere(SPMDLayoutError, lambda: spmdmoe.all_gather(torch.zeros(2)), match="takes an SPMDTensor")
    v = SPMDTensor(torch.zeros(1, 2, device=device), world, Varying())
    assert_raises_everywhere(SPMDLayoutError, lambda: spmdmoe.redistribute(v, Replicate()), match="no transition")
    assert_raises_everywhere(SPMDLayoutError, lambda: spmdmoe.redistribute(rep, Shard(1)), match="token dim")


def test_mismatched_meshes(world, mesh2d, device):
    x = spmdmoe.shard(torch.zeros(5, 2, device=device), world)
    assert_raises_everywhere(SPMDMeshError, lambda: spmdmoe.all_gather(x, mesh=mesh2d["dp"]),
                             match="asked to run on .* but the tensor lives on")
    assert spmdmoe.all_gather(x, mesh=world).global_tokens == 5


def test_non_contiguous_buffer(world, device):
    buf = torch.zeros(4, 8, device=device).t()
    assert_raises_everywhere(SPMDLayoutError, lambda: SPMDTensor.from_buffer(buf, world, Partial(), global_tokens=8),
                             match="must be contiguous")


def test_non_contiguous_input_is_fine(world, device):
    full = torch.arange(40.0, device=device).view(8, 5)
    x = spmdmoe.from_local(full.t().contiguous().t()[:, :3], world, placement=Replicate())
    assert not x.local.is_contiguous()
    assert torch.equal(spmdmoe.redistribute(spmdmoe.redistribute(x, Shard(0)), Replicate()).local, full[:, :3])


def test_bad_counts_on_one_rank(world, device):
    n, r = world.size(), world.get_local_rank()
    x = SPMDTensor(torch.zeros(2, 3, device=device), world, Varying())
    counts = [2] + [0] * (n - 1)
    wrong = [3] + [0] * (n - 1) if r == 1 else counts  # sums to 3 but only 2 rows
    assert_raises_everywhere(SPMDLayoutError, lambda: spmdmoe.all_to_all(x, torch.tensor(wrong, device=device)),
                             match=r"all_to_all rejected the input on 1 of \d+ ranks \(rank 1: bad counts\)")
    short = counts[:-1] if r == 0 else counts
    assert_raises_everywhere(SPMDLayoutError, lambda: spmdmoe.all_to_all(x, torch.tensor(short, device=device)),
                             match=r"\(rank 0: bad counts\)")
    negative = [3, -1] + [0] * (n - 2) if r == 0 else counts
    assert_raises_everywhere(SPMDLayoutError, lambda: spmdmoe.all_to_all(x, torch.tensor(negative, device=device)))
    recv = [2] * n if r == 0 else [0] * n
    host_wrong = [1] + [0] * (n - 1) if r == 2 % n else counts
    assert_raises_everywhere(SPMDLayoutError, lambda: spmdmoe.all_to_all(x, host_wrong, recv),
                             match=rf"\(rank {2 % n}: bad counts\)")
    huge = [2**63] + [0] * (n - 1) if r == n - 1 else counts  # past int64: torch.tensor would raise on that rank
    assert_raises_everywhere(SPMDLayoutError, lambda: spmdmoe.all_to_all(x, huge), match=rf"\(rank {n - 1}: bad counts\)")
    host_short = counts[:-1] if r == 0 else counts  # a host list of the wrong length, exchanged on device
    assert_raises_everywhere(SPMDLayoutError, lambda: spmdmoe.all_to_all(x, host_short), match=r"\(rank 0: bad counts\)")


def test_host_recv_counts_that_contradict_the_senders_raise_everywhere(world, device):
    """Issue 24: consistent send counts, but ONE rank's receive counts disagree with what its peers send it
    (before: a gloo error on that rank, the others hung in the exchange). Every rank raises, naming it."""
    n, r = world.size(), world.get_local_rank()
    x = SPMDTensor(torch.full((2, 3), float(r), device=device), world, Varying())
    send = [2] + [0] * (n - 1)  # every rank sends its 2 rows to rank 0
    recv = [2] * n if r == 0 else [0] * n
    bad = n - 1
    wrong = ([1] + [0] * (n - 1) if bad else [2] * (n - 1) + [3]) if r == bad else recv
    assert_raises_everywhere(SPMDLayoutError, lambda: spmdmoe.all_to_all(x, send, wrong),
                             match=rf"\(rank {bad}: bad counts\)")
    assert spmdmoe.all_to_all(x, send, recv).local_tokens == (2 * n if r == 0 else 0)  # and the group still works


def test_numpy_split_sizes_are_ints(world, device):
    """Issue 15: NumPy integer split sizes are ints."""
    import numpy as np

    n, r = world.size(), world.get_local_rank()
    x = SPMDTensor(torch.full((2, 3), float(r), device=device), world, Varying())
    send = np.array([2] + [0] * (n - 1), dtype=np.int64)  # every rank sends its 2 rows to rank 0
    recv = np.array([2] * n if r == 0 else [0] * n, dtype=np.int64)
    y = spmdmoe.all_to_all(x, list(send), list(recv))
    assert y.local_tokens == (2 * n if r == 0 else 0)
    z = spmdmoe.all_to_all(x, list(send))  # exchanged on device
    assert torch.equal(z.local, y.local)


def test_exchange_counts_widths_differ_on_one_rank(world, device):
    """Issue 4: count tensors of another width on one rank used to abort the process (gloo size
    mismatch); the width is agreed first, so every rank raises."""
    n, r = world.size(), world.get_local_rank()
    width = 3 if r == n - 1 else 2
    counts = torch.zeros(n, width, dtype=torch.int64, device=device)
    assert_raises_everywhere(SPMDLayoutError, lambda: spmdmoe.exchange_counts(counts, world),
                             match=r"ranks disagree on the count width")
    lead = torch.zeros(n + (1 if r == 0 else 0), 2, dtype=torch.int64, device=device)
    assert_raises_everywhere(SPMDLayoutError, lambda: spmdmoe.exchange_counts(lead, world), match=r"rank 0: bad counts")
    send, recv = spmdmoe.exchange_counts(torch.ones(n, 2, dtype=torch.int64, device=device), world, rows=2 * n)
    assert send == [1] * 2 * n and recv == [1] * 2 * n


def test_dtype_mismatch_detected_by_from_local(world, device):
    dtype = torch.float16 if world.get_local_rank() == 0 else torch.float32
    assert_raises_everywhere(SPMDLayoutError,
                             lambda: spmdmoe.from_local(torch.zeros(2, 2, device=device, dtype=dtype), world),
                             match="disagree on the dtype")
