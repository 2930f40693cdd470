"""The agreement mechanism on one process: verdicts, precedence, messages, the sticky flag."""

import pytest
import torch

import spmdmoe
from spmdmoe import MoEConfigError, SPMDDeviceError, SPMDLayoutError, SPMDShapeError, SPMDTokenCountError
from spmdmoe.agreement import BIT, KINDS, Field, Problem, agree, dtype_code, dtype_name, problems_error
from spmdmoe.sticky import ProblemFlag
from spmdmoe.host import host_sync_count
from spmdmoe.testing import sync_error_mode


@pytest.fixture(scope="module")
def pg():
    return spmdmoe.testing.single_process_group()


def test_kinds_are_one_bit_each_and_fit_int64():
    assert len(KINDS) <= 63 and len(set(BIT.values())) == len(KINDS)
    assert all(v & (v - 1) == 0 for v in BIT.values())


def test_verdict_names_every_bad_rank_and_picks_the_most_specific_error():
    err = problems_error("op", [0, BIT["counts"], BIT["device"] | BIT["width"], 0], ["rank 2: my detail"])
    assert isinstance(err, SPMDDeviceError)  # device outranks counts and width
    text = str(err)
    assert "op rejected the input on 2 of 4 ranks" in text
    assert "rank 1: bad counts" in text and "rank 2: tensor on a device the backend cannot use, input width" in text
    assert text.endswith("this rank: rank 2: my detail")
    assert problems_error("op", [0, 0]) is None
    assert isinstance(problems_error("op", [BIT["width"]]), SPMDShapeError)
    assert isinstance(problems_error("op", [BIT["tokens_negative"]]), SPMDTokenCountError)


def test_global_ranks_in_messages():
    err = problems_error("op", [0, BIT["config"]], ranks=[4, 6])
    assert isinstance(err, MoEConfigError) and "(rank 6: MoE config" in str(err)


def test_agree_raises_on_problems_and_returns_the_table(pg):
    found = Problem()
    assert not found
    table = agree("op", None, found, [(Field("width"), 7)], extra=[3])
    assert table == [[0, 7, 3]]
    found.add("token_dim", "rank 0: detail")
    with pytest.raises(SPMDLayoutError, match=r"op rejected the input on 1 of 1 ranks \(rank 0: token dim out of range\)"):
        agree("op", None, found)


def test_dtype_codes_round_trip():
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        assert dtype_name(dtype_code(dtype)) == str(dtype).replace("torch.", "")
    assert dtype_name(-1) == "another dtype"


def test_sticky_flag_records_without_reading_and_raises_once(pg):
    flag = ProblemFlag()
    flag.record(0, torch.device("cpu"))  # nothing to record: no tensor made
    assert flag.slots(torch.device("cpu")).tolist() == [0]
    flag.record(torch.tensor(BIT["nonfinite"]), torch.device("cpu"), ["rank 0: inf in row 3"])
    flag.record(BIT["width"], torch.device("cpu"))
    assert flag.slots(torch.device("cpu")).tolist() == [BIT["nonfinite"] | BIT["width"]]
    with pytest.raises(spmdmoe.SPMDShapeError, match=r"check_errors rejected the input on 1 of 1 ranks"):
        spmdmoe.check_errors()
    spmdmoe.check_errors()  # cleared
    assert flag.slots(torch.device("cpu")).tolist() == [0]


def test_single_device_nonfinite_input_raises_at_the_step_boundary(pg):
    from spmdmoe.moe import MoE, MoEConfig

    moe = MoE(MoEConfig(dim=8, hidden_dim=16, num_experts=4, top_k=2, load_balance_coeff=1e-3))
    x = torch.randn(5, 8)
    x[2, 1] = float("nan")
    moe(x).sum().backward()  # the forward does not sync to look
    with pytest.raises(spmdmoe.SPMDRoutingError, match="non-finite router logits"):
        moe.update_expert_bias()
    assert moe.expert_bias.abs().sum() == 0  # the bad step never reached the bias
    moe(torch.randn(5, 8)).sum().backward()
    moe.update_expert_bias()  # clean again
    with spmdmoe.checks(False):  # checks off: no pass over the logits, nothing recorded
        moe(x).sum().backward()
    moe.update_expert_bias()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_checks_make_no_host_sync_on_cuda():
    """One device: the forward and backward (router, counting, dispatch kernels, grouped GEMMs, combine,
    the input check and the non-finite pass) make no host sync. Checked with CUDA's sync debug mode in
    "error" (any synchronizing call raises), not with a counter; the bias update's one documented read
    is the only transfer, allowed by ``to_host`` for itself and counted."""
    from spmdmoe.moe import MoE, MoEConfig

    moe = MoE(MoEConfig(dim=64, hidden_dim=32, num_experts=8, top_k=2, load_balance_coeff=1e-3)).cuda().bfloat16()
    x = torch.randn(50, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    moe(x).sum().backward()  # warm-up: first-time allocations and the flag itself
    torch.cuda.synchronize()

    assert spmdmoe.checks_enabled()
    before = host_sync_count()
    y = sync_error_mode(lambda: moe(x))
    sync_error_mode(lambda: y.sum().backward())
    assert host_sync_count() == before  # one device, no EP: not even a documented one
    sync_error_mode(moe.update_expert_bias)  # its one documented read is allowed (spmdmoe.host.to_host) ...
    assert host_sync_count() == before + 1  # ... and counted
    with pytest.raises(RuntimeError, match="synchroniz"):  # the mode itself is on: any other sync raises
        sync_error_mode(lambda: moe.tokens_per_expert.sum().item())


def test_documented_row_widths(pg, monkeypatch):
    """The docs say from_local exchanges 8 int64 per rank and parallelize_moe 19: keep them true."""
    import spmdmoe.agreement as agreement
    from spmdmoe.moe import MoE, MoEConfig, parallelize_moe

    widths = []
    real = agreement.exchange_rows
    monkeypatch.setattr(agreement, "exchange_rows", lambda axis, row, op, bits=0: (widths.append(len(row)),
                                                                                   real(axis, row, op, bits))[1])
    spmdmoe.from_local(torch.zeros(3, 2), pg)
    parallelize_moe(MoE(MoEConfig(dim=8, hidden_dim=16, num_experts=4, top_k=2)), ep_mesh=pg)
    assert widths == [8, 19]


def test_weights_fingerprint_sees_permutations():
    """The fingerprint is position-weighted: a transposed w1 (D == F, so the same shape) or two swapped
    experts change it; the same weights give the same value."""
    from spmdmoe.moe import MoE, MoEConfig
    from spmdmoe.moe.parallel.plan import weights_fingerprint

    torch.manual_seed(0)
    moe = MoE(MoEConfig(dim=8, hidden_dim=8, num_experts=4, top_k=2))
    base = weights_fingerprint(moe)
    assert base == weights_fingerprint(moe) and base != -1
    with torch.no_grad():
        moe.experts.w1.copy_(moe.experts.w1.transpose(1, 2).clone())
    assert weights_fingerprint(moe) != base
    torch.manual_seed(0)
    moe = MoE(MoEConfig(dim=8, hidden_dim=8, num_experts=4, top_k=2))
    with torch.no_grad():
        moe.experts.w2.copy_(moe.experts.w2[[1, 0, 2, 3]].clone())
    assert weights_fingerprint(moe) != base


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_delayed_read_returns_the_values_of_when_it_started(device):
    """The ride of deferred problems (``spmdmoe.moe.parallel.ride``): a copy started now, read later. On CUDA the start
    makes no host sync (sync debug mode "error"), later writes to the source do not change what is read, and
    the read is counted as a transfer."""
    from spmdmoe.host import DelayedRead

    t = torch.arange(6, dtype=torch.int64, device=device).view(3, 2)
    read = sync_error_mode(lambda: DelayedRead(t[:, 1:])) if device == "cuda" else DelayedRead(t[:, 1:])
    t.fill_(-1)
    before = host_sync_count()
    assert read.get() == [[1], [3], [5]]
    assert read.get() == [[1], [3], [5]]  # read once, counted once
    assert host_sync_count() == before + 1


def test_problem_flag_generation_counts_clears():
    flag = ProblemFlag()
    out = torch.zeros(1, dtype=torch.int64)
    flag.bits_into(out)
    assert int(out) == 0 and flag.generation == 0
    flag.record(BIT["width"], torch.device("cpu"), ["rank 0: detail"])
    flag.bits_into(out)
    assert int(out) == BIT["width"]
    flag.clear()
    assert flag.generation == 1 and flag.details == []


def test_one_problem_from_where_it_is_found_to_its_sink():
    """A forward's ``Problem``: host findings read as a bool; once a device-side check joined, reading it on the host
    raises (it would sync) and only its sink (the layer's sticky flag) takes the bits, with this rank's details."""
    flag = ProblemFlag()
    problem = Problem(flag=flag)
    assert not problem
    problem.add("width", "rank 0: width 7, not 8")
    assert problem and problem.bits == BIT["width"]
    problem.add_device(torch.tensor(BIT["nonfinite"]))
    with pytest.raises(TypeError, match="sync"):
        bool(problem)
    problem.record(problem.bits, torch.device("cpu"))
    with pytest.raises(SPMDShapeError, match="width 7, not 8") as raised:
        spmdmoe.check_errors()
    assert "non-finite router logits" in str(raised.value)
