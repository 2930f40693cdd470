"""``spmdmoe.integrations.transformers.swap_moe`` over n processes (4 on gloo in CI; NCCL on 2 or 4 GPUs),
against the one-process unswapped model from the same seed (``tests/hf_models.py``; fp32).

- Whole models under EP = n: each rank runs its own batch (sizes and lengths differ by rank), its 8 / n
  experts take every rank's tokens.
- One MoE block under SP x EP with a sequence that does not divide by the SP size (37 tokens): ``sp_ep``
  (SP = EP = world) and, on 4 ranks, ``sp_x_ep`` (2x2: two batches, one per EP index, each split over SP).
- Whole models under 2x2 SP x EP where the SP chunks are whole sequences (transformers' attention does not
  gather keys over SP: ``docs/porting.md``).
- Whole models sequence-parallel (``transformers_sp.sequence_parallel``: keys and values gathered over SP,
  global positions, dense gradients summed over SP) on a 37-token sequence, SP = EP = world and 2x2; a bad
  input on one rank raises on every rank.
- FSDP2 over a swapped model (data parallel, each rank its own batch).

Tolerances: outputs and the loss within 1e-5 of the largest magnitude, gradients within 1e-4 of theirs
(summation order differs). Dense gradients cover the rank's batch (summed over SP inside the layer);
expert gradients every batch (their rows of the sum).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/hf_models.py
from hf_models import D, MODELS, VOCAB  # noqa: E402

import spmdmoe  # noqa: E402
from spmdmoe import SPMDLayoutError  # noqa: E402
from spmdmoe.integrations.transformers import SwappedMoeBlock, swap_moe  # noqa: E402
from spmdmoe.integrations.transformers_sp import sequence_parallel, sp_batch  # noqa: E402
from spmdmoe.testing import assert_raises_everywhere  # noqa: E402
from spmdmoe.types.errors import MoEConfigError  # noqa: E402


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max()) <= tol * max(float(a.abs().max()), 1e-30)


def _expert_rows(grad: torch.Tensor, q: DTensor) -> torch.Tensor:
    """This rank's rows (``Shard(0)`` over the EP mesh) of a full expert gradient."""
    e = q.to_local().shape[0]
    index = q.device_mesh.get_local_rank()
    return grad[index * e:(index + 1) * e]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_under_ep_each_rank_its_own_batch(name, world, device):
    rank = dist.get_rank()
    ref = MODELS[name](0).to(device)
    ours = copy.deepcopy(ref)
    swap_moe(ours, ep_mesh=world)
    ids = torch.randint(0, VOCAB, (1 + rank % 2, 5 + 2 * rank), generator=torch.Generator().manual_seed(rank)).to(device)
    a = ref(input_ids=ids, labels=ids, output_router_logits=True)
    b = ours(input_ids=ids, labels=ids, output_router_logits=True)
    assert _close(a.logits, b.logits, 1e-5) and _close(a.loss, b.loss, 1e-5)
    assert all(_close(x, y, 1e-5) for x, y in zip(a.router_logits, b.router_logits))
    a.loss.backward()
    b.loss.backward()
    for (pname, p), q in zip(ref.named_parameters(), ours.parameters()):
        if isinstance(q, DTensor):  # an expert weight: every rank's tokens reach it
            total = p.grad.detach().clone()
            dist.all_reduce(total)
            assert _close(_expert_rows(total, q), q.grad.to_local(), 1e-4), pname
        else:
            assert _close(p.grad, q.grad, 1e-4), pname


def test_sync_free_sizes_from_swap_moe(world, device):
    """``swap_moe`` passes ``max_tokens`` (and ``capacity_factor``) to the layers, the fix the capacity error names:
    a sync-free model sized for 12 tokens a rank matches transformers' on 12 (each rank its own batch), and when
    the last rank routes 13, every rank raises SPMDCapacityError at the step boundary (that rank naming the bound)."""
    name, rank, last = sorted(MODELS)[0], dist.get_rank(), dist.get_world_size() - 1
    ref = MODELS[name](0).to(device)
    ours = copy.deepcopy(ref)
    swap_moe(ours, ep_mesh=world, ep_mode="sync_free", max_tokens=12, capacity_factor=None)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(rank)).to(device)
    assert _close(ref(input_ids=ids).logits, ours(input_ids=ids).logits, 1e-5)
    spmdmoe.check_errors()
    ids = torch.randint(0, VOCAB, (1, 13 if rank == last else 12)).to(device)
    ours(input_ids=ids, labels=ids).loss.backward()
    err = assert_raises_everywhere(spmdmoe.SPMDCapacityError, spmdmoe.check_errors,
                                   match=rf"rank {last}: more rows than the sync-free EP buffers hold")
    assert rank != last or str(err).count("13 tokens routed, more than max_tokens=12") == 1, str(err)  # its own
    # detail, once (each of the model's two layers recorded it)


def _plan(plan: str, world, request):  # type: ignore[no-untyped-def]
    """``(ep, sp, batches, this rank's batch)``: ``sp_x_ep`` is the 2x2 mesh (2 x world / 2 on more ranks; EP
    "dp", SP "sp": a batch per EP index), anything else SP = EP = world (one batch)."""
    if not plan.startswith("sp_x_ep"):
        return world, world, 1, 0
    mesh = request.getfixturevalue("mesh2d_wide")
    return mesh["dp"], mesh["sp"], 2, mesh["dp"].get_local_rank()


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("plan", ["sp_ep", "sp_x_ep"])
def test_block_under_sp_and_ep_uneven_sequence(name, plan, world, request, device):
    """The last layer's MoE block, each rank its chunk of a 37-token sequence (chunk rule) of its batch."""
    ep, sp, batches, mine = _plan(plan, world, request)
    ref_model = MODELS[name](0).to(device)
    ours_model = copy.deepcopy(ref_model)
    swap_moe(ours_model, sp_mesh=sp, ep_mesh=ep)
    ref, ours = ref_model.model.layers[-1].mlp, ours_model.model.layers[-1].mlp
    g = torch.Generator().manual_seed(5)
    X = [torch.randn(1, 37, D, generator=g).to(device) for _ in range(batches)]
    G = [torch.randn(1, 37, D, generator=g).to(device) for _ in range(batches)]
    grads = []
    for x, gy in zip(X, G):  # the reference gradients of each batch
        ref.zero_grad()
        x = x.clone().requires_grad_()
        (ref(x) * gy).sum().backward()
        grads.append(({n: p.grad.clone() for n, p in ref.named_parameters()}, x.grad))
    with torch.no_grad():
        y_ref = ref(X[mine])
    x_local = spmdmoe.shard(X[mine], sp, dim=1).local.detach().clone().requires_grad_()
    y = ours(x_local)
    (y * spmdmoe.shard(G[mine], sp, dim=1).local).sum().backward()
    assert _close(spmdmoe.shard(y_ref, sp, dim=1).local, y, 1e-5)
    assert _close(spmdmoe.shard(grads[mine][1], sp, dim=1).local, x_local.grad, 1e-4)
    for pname, q in ours.named_parameters():
        if isinstance(q, DTensor):
            want = _expert_rows(sum(gr[pname] for gr, _ in grads), q)
            assert _close(want, q.grad.to_local(), 1e-4), pname
        else:
            assert _close(grads[mine][0][pname], q.grad, 1e-4), pname


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_under_sp_x_ep_whole_samples(name, request, device):
    """The whole model on a 2x2 mesh (EP "dp", SP "sp"): each EP index has its own batch of 4 sequences, split
    over SP by the chunk rule into 2 whole sequences a rank (so transformers' attention needs nothing from the
    other rank). Each rank's loss is half its batch's (its share of the batch mean). The layer sums its gate
    and shared experts' gradients over SP itself; the test sums the rest of the model's over SP (what the
    caller's data parallelism does, ``docs/porting.md``), and compares all with one process running both
    batches."""
    if dist.get_world_size() != 4:
        pytest.skip("the 2x2 plan needs 4 ranks")
    mesh = request.getfixturevalue("mesh2x2")
    ep, sp = mesh["dp"], mesh["sp"]
    b, s = ep.get_local_rank(), sp.get_local_rank()
    ref = MODELS[name](0).to(device)
    ours = copy.deepcopy(ref)
    swap_moe(ours, sp_mesh=sp, ep_mesh=ep)
    batches = [torch.randint(0, VOCAB, (4, 9), generator=torch.Generator().manual_seed(20 + i)).to(device)
               for i in range(2)]
    ref_grads = []
    for ids in batches:
        ref.zero_grad()
        ref(input_ids=ids, labels=ids).loss.backward()
        ref_grads.append({n: p.grad.clone() for n, p in ref.named_parameters()})
    mine = spmdmoe.shard(batches[b].reshape(-1), sp).local.view(-1, 9)  # 36 tokens: 18 a rank, 2 sequences
    out = ours(input_ids=mine, labels=mine)
    with torch.no_grad():
        want = ref(input_ids=batches[b]).logits[2 * s:2 * s + 2]
    assert _close(want, out.logits, 1e-5)
    (out.loss / sp.size()).backward()
    moe_dense = {n for n, _ in ours.named_parameters() if ".mlp.gate." in n or ".mlp.shared_experts." in n}
    assert moe_dense and all(isinstance(ours.get_submodule(n.split(".mlp.")[0] + ".mlp"), SwappedMoeBlock)
                             for n in moe_dense)
    for pname, q in ours.named_parameters():
        if isinstance(q, DTensor):  # experts: both batches' tokens
            want = _expert_rows(ref_grads[0][pname] + ref_grads[1][pname], q)
            assert _close(want, q.grad.to_local(), 1e-4), pname
            continue
        got = q.grad.detach().clone()
        if pname not in moe_dense:  # the caller's reduction over the SP axis
            dist.all_reduce(got, group=sp.get_group())
        assert _close(ref_grads[b][pname], got, 1e-4), pname


def _sp_model(name: str, sp, ep, device, tied: bool = False):  # type: ignore[no-untyped-def]
    ref = MODELS[name](0).to(device)
    if tied:  # tie_word_embeddings: the output head is the embedding table
        ref.lm_head.weight = ref.model.embed_tokens.weight
    ours = copy.deepcopy(ref)
    swap_moe(ours, sp_mesh=sp, ep_mesh=ep)
    return ref, sequence_parallel(ours, sp)


def _batch(kind: str, seed: int, device):  # type: ignore[no-untyped-def]
    """``(transformers' keywords, sp_batch's keywords)`` of one batch: ``one`` a 37-token sequence; ``masked pair``
    2 rows of 13 tokens (odd: the stream of 26 splits unevenly), left padding in the first, right in the second,
    with the padding's labels ignored; ``packed`` 3 documents in one row (positions restart; transformers packs
    them only without a cache)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "one":
        ids = torch.randint(0, VOCAB, (1, 37), generator=g).to(device)
        return dict(input_ids=ids, labels=ids), dict(input_ids_BS=ids)
    if kind == "masked pair":
        ids = torch.randint(0, VOCAB, (2, 13), generator=g).to(device)
        mask = torch.ones(2, 13, dtype=torch.long, device=device)
        mask[0, :3] = mask[1, -4:] = 0
        return (dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)),
                dict(input_ids_BS=ids, attention_mask=mask))
    ids = torch.randint(0, VOCAB, (1, 19), generator=g).to(device)
    positions = torch.tensor([[*range(7), *range(5), *range(7)]], device=device)
    return (dict(input_ids=ids, labels=ids, position_ids=positions, use_cache=False),
            dict(input_ids_BS=ids, position_ids=positions))


@pytest.mark.parametrize("name,plan,kind", [(name, plan, "one") for name in sorted(MODELS)
                                            for plan in ("sp_ep", "sp_x_ep")]
                         + [("qwen3_moe", "sp_ep, checkpointed", "one")]
                         + [(name, "sp_x_ep" + (", checkpointed" if name == "qwen3_moe" else ""), "masked pair")
                            for name in sorted(MODELS)]
                         + [("qwen3_moe", "sp_ep", "packed"), ("qwen3_moe", "sp_ep, tied", "masked pair")])
def test_whole_model_sequence_parallel(name, plan, kind, world, request, device):
    """Each rank its chunk of a batch (``sp_batch``, the rows end to end); the sum of the ranks' losses is the
    one-process loss (with Qwen3-MoE's and Mixtral's load-balancing loss, whose ranks' shares sum to the one-process
    ``aux_loss``), the logits are its rows, every gradient its gradient (dense: summed over SP inside; experts:
    every batch's, their rows). ``sp_x_ep``: two batches, one per EP index, each split over SP;
    ``checkpointed``: transformers' activation checkpointing of the decoder layers (the recompute gathers again);
    ``tied``: the output head tied to the embeddings (one gradient sum over SP for both uses)."""
    ep, sp, batches, mine = _plan(plan, world, request)
    ref, ours = _sp_model(name, sp, ep, device, tied=plan.endswith("tied"))
    assert not plan.endswith("tied") or ours.lm_head.weight is ours.model.embed_tokens.weight
    if plan.endswith("checkpointed"):
        ours.activation_checkpointing_enable()
    balance = {"output_router_logits": True} if name != "deepseek_v3" else {}
    calls = [_batch(kind, 30 + i, device) for i in range(batches)]
    ref_grads, ref_out = [], []
    for call, _ in calls:
        ref.zero_grad()
        out = ref(**call, **balance)
        out.loss.backward()
        ref_out.append(out)
        ref_grads.append({n: p.grad.clone() for n, p in ref.named_parameters()})
    out = ours(**sp_batch(sp_mesh=sp, **calls[mine][1]), **balance)
    out.loss.backward()
    for got, want in [(out.loss, ref_out[mine].loss)] + ([(out.aux_loss, ref_out[mine].aux_loss)] if balance else []):
        total = got.detach().clone()
        dist.all_reduce(total, group=sp.get_group())
        assert _close(want, total, 1e-5)
    logits = ref_out[mine].logits
    assert _close(spmdmoe.shard(logits.reshape(1, -1, logits.shape[-1]), sp, dim=1).local, out.logits, 1e-5)
    for pname, q in ours.named_parameters():
        if isinstance(q, DTensor):
            assert _close(_expert_rows(sum(g[pname] for g in ref_grads), q), q.grad.to_local(), 1e-4), pname
        else:
            assert _close(ref_grads[mine][pname], q.grad, 1e-4), pname


def _imbalance(model: torch.nn.Module) -> float:
    """``E * sum_e share_e ** 2`` of the routed copies in the model's last forward (every layer, summed over the
    ranks; from the ids each gate's hooks see): 1 when every expert takes as many, ``E / K`` when ``K`` take all."""
    counts = torch.stack([m.gate._spmdmoe_seen for m in model.modules() if isinstance(m, SwappedMoeBlock)]).sum(0)
    dist.all_reduce(counts)
    share = counts / counts.sum()
    return float((share * share).sum() * share.numel())


@pytest.mark.training_run
def test_load_balancing_balances_training_under_sp_x_ep(world, request, device):
    """Qwen3-MoE swapped with SP x EP (2x2 on 4 ranks), trained 50 steps (Adam at 1e-3) on batches of 2 rows of odd
    length with an attention mask, its router skewed at the start (experts 0 and 1's gate rows scaled by 8): with
    the load-balancing loss (``output_router_logits``, coefficient 10), or with the aux-loss-free bias update
    (``swap_moe(load_balance_coeff=5e-3)``), the load's imbalance on a fixed evaluation batch per EP index
    (:func:`_imbalance`) falls from 1.48 to under 1.1 (measured 1.02) or 1.15 (1.05); the same steps with neither
    leave it above 1.2 (1.31). That the loss covers the
    whole batch is ``test_whole_model_sequence_parallel``'s; here it must act."""
    ep, sp, _, mine = _plan("sp_x_ep", world, request)
    probe = torch.randint(0, VOCAB, (4, 31), generator=torch.Generator().manual_seed(7 + mine)).to(device)
    seen: dict[str, list[float]] = {}  # the imbalance at the start and after 50 steps
    for mode in ("aux loss", "bias update", "neither"):
        model = copy.deepcopy(MODELS["qwen3_moe"](0)).to(device)
        model.router_aux_loss_coef = 10.0
        swap_moe(model, sp_mesh=sp, ep_mesh=ep, load_balance_coeff=5e-3 if mode == "bias update" else None)
        sequence_parallel(model, sp)
        for m in model.modules():
            if isinstance(m, SwappedMoeBlock):
                with torch.no_grad():
                    m.gate.weight[:2] *= 8
                m.gate.register_forward_hook(lambda gate, args, out: setattr(
                    gate, "_spmdmoe_seen", torch.bincount(out[2].reshape(-1), minlength=8).float()))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        seen[mode] = []
        for step in range(51):
            if step in (0, 50):
                with torch.no_grad():
                    model(**sp_batch(probe, sp))
                seen[mode].append(_imbalance(model))
            if step == 50:
                break
            out = model(**sp_batch(sp_mesh=sp, **_batch("masked pair", 100 * mine + step, device)[1]),
                        output_router_logits=mode == "aux loss")
            out.loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    assert seen["aux loss"][0] == seen["bias update"][0] == seen["neither"][0] > 1.4, seen  # the same skewed start
    assert seen["aux loss"][1] < 1.1 and seen["bias update"][1] < 1.15 and seen["neither"][1] > 1.2, seen


@pytest.mark.one_rank_bad
def test_sequence_parallel_bad_input_on_one_rank_raises_everywhere(world, device):
    """One rank passes an attention mask to the model, a chunk one token too long, the load-balancing loss its
    peers do not ask for, a KV cache, or its chunk without sp_batch's keywords: every rank raises, none hangs."""
    _, ours = _sp_model("qwen3_moe", world, world, device)
    ids = torch.randint(0, VOCAB, (1, 37), generator=torch.Generator().manual_seed(40)).to(device)
    batch = sp_batch(ids, world)
    masked = dict(batch, attention_mask=torch.ones_like(batch["input_ids"])) if dist.get_rank() == 1 else batch
    caught = assert_raises_everywhere(MoEConfigError, lambda: ours(**masked), match="rank 1")  # who found it
    assert dist.get_rank() != 1 or "sp_batch(..., attention_mask=...)" in str(caught), caught  # and the fix
    longer = ids[:, :batch["input_ids"].shape[1] + 1]
    wrong = dict(batch, input_ids=longer, labels=longer) if dist.get_rank() == 0 else batch
    assert_raises_everywhere(SPMDLayoutError, lambda: ours(**wrong), match="rank 0")
    last = dist.get_world_size() - 1
    asks = {"output_router_logits": dist.get_rank() == last}
    assert_raises_everywhere(MoEConfigError, lambda: ours(**batch, **asks), match="load-balancing loss")
    bare = {k: v for k, v in batch.items() if k != "spmdmoe_batch"}
    for bad, words in (({"use_cache": True}, "use_cache=False"), ({}, "sp_batch")):
        call = dict(bare if not bad else batch, **bad) if dist.get_rank() == last else batch
        caught = assert_raises_everywhere(MoEConfigError, lambda: ours(**call), match=f"rank {last}")
        assert dist.get_rank() != last or words in str(caught), caught


def test_sequence_parallel_refusals(world, device):
    """A second application is refused (it would sum the dense gradients twice)."""
    _, ours = _sp_model("qwen3_moe", world, world, device)
    with pytest.raises(MoEConfigError, match="already applied"):
        sequence_parallel(ours, world)


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_fsdp2_over_a_swapped_model(name, world, device):
    """FSDP2 (``fully_shard`` of each decoder layer, then the model) over a swapped model, each rank its own batch:
    the loss is the unswapped model's on that batch, every full gradient the ranks' mean of the unswapped model's
    (the fused expert parameters are sharded and gathered by FSDP2 like any other)."""
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    ref = MODELS[name](0).to(device)
    ours = copy.deepcopy(ref)
    swap_moe(ours)
    for layer in ours.model.layers:
        fully_shard(layer, mesh=world)
    fully_shard(ours, mesh=world)
    ids = torch.randint(0, VOCAB, (1 + rank % 2, 9), generator=torch.Generator().manual_seed(50 + rank)).to(device)
    a, b = ref(input_ids=ids, labels=ids), ours(input_ids=ids, labels=ids)
    assert _close(a.loss, b.loss, 1e-5)
    a.loss.backward()
    b.loss.backward()
    for (pname, p), q in zip(ref.named_parameters(), ours.parameters()):
        mean = p.grad.detach().clone()
        dist.all_reduce(mean)
        assert _close(mean / dist.get_world_size(), q.grad.full_tensor(), 1e-4), pname
