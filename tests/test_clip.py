"""``spmdmoe.clip_grad_norm_`` on one process is ``torch.nn.utils.clip_grad_norm_``, bit for bit.

A model with an MoE layer parallelized over 1-rank axes, a ``replicate_grads`` module and a module whose
gradient is ``None``: the returned norm and every clipped gradient equal torch's on a copy of the same
gradients exactly (``torch.equal``), for norm types 2, inf and 1.5, with ``foreach`` on, off and default,
with the clip active and not. Non-finite norms and bad norm types behave as torch's (or raise with the fix).
The multi-rank cases are ``tests/distributed/test_clip.py``.
"""

import math

import pytest
import torch
import torch.nn as nn

import spmdmoe
from spmdmoe.moe import MoE, MoEConfig, parallelize_moe, replicate_grads
from spmdmoe.testing import reference_tensor

D = 8


@pytest.fixture(scope="module")
def pg():
    return spmdmoe.testing.single_process_group()


def _model(pg):
    torch.manual_seed(0)
    cfg = MoEConfig(dim=D, hidden_dim=16, num_experts=4, top_k=2, num_shared_experts=1)
    model = nn.ModuleDict({
        "inp": replicate_grads(nn.Linear(D, D), pg),
        "moe": parallelize_moe(MoE(cfg), ep_mesh=pg),
        "unused": nn.Linear(D, 3),  # no gradient: None, as torch leaves it
    })
    x = reference_tensor((11, D), 1)
    (model["moe"](model["inp"](x)).square().sum() * 1e5).backward()  # norms well above the 1e-6 of the coefficient
    return model


def _copies(model):
    """Fresh leaves holding clones of the model's gradients, for torch's function."""
    out = []
    for p in model.parameters():
        q = nn.Parameter(p.detach().clone())
        q.grad = None if p.grad is None else p.grad.clone()
        out.append(q)
    return out


@pytest.mark.parametrize("foreach", [None, True, False])
@pytest.mark.parametrize("norm_type", [2.0, math.inf, 1.5])
@pytest.mark.parametrize("fraction", [0.1, 10.0])  # of the norm: the clip active, and not
def test_equals_torch_bitwise(pg, norm_type, foreach, fraction):
    model = _model(pg)
    ref = _copies(model)
    assert model["unused"].weight.grad is None
    max_norm = fraction * float(torch.nn.utils.get_total_norm([q.grad for q in ref if q.grad is not None], norm_type))
    want = torch.nn.utils.clip_grad_norm_(ref, max_norm, norm_type, foreach=foreach)
    got = spmdmoe.clip_grad_norm_(model, max_norm, norm_type, foreach=foreach)
    assert torch.equal(got, want) and got.dtype == want.dtype, (got, want)
    for (name, p), q in zip(model.named_parameters(), ref):
        assert (p.grad is None) == (q.grad is None), name
        assert p.grad is None or torch.equal(p.grad, q.grad), name
    if fraction < 1:  # the clip was active: the clipped gradients' norm is max_norm
        after = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None], norm_type)
        assert math.isclose(float(after), max_norm, rel_tol=1e-5)


def test_parameters_and_a_single_tensor(pg):
    """A list of parameters (one process: no model needed) and a single tensor, as torch takes them."""
    model = _model(pg)
    ref = _copies(model)
    want = torch.nn.utils.clip_grad_norm_(ref, 0.5)
    assert torch.equal(spmdmoe.clip_grad_norm_(list(model.parameters()), 0.5), want)
    w = model["inp"].weight
    w.grad = reference_tensor(w.shape, 3)
    ref_w = nn.Parameter(w.detach().clone())
    ref_w.grad = w.grad.clone()
    assert torch.equal(spmdmoe.clip_grad_norm_(w, 0.5), torch.nn.utils.clip_grad_norm_(ref_w, 0.5))
    assert torch.equal(w.grad, ref_w.grad)


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_non_finite(pg, norm_type):
    """A NaN gradient: the norm is NaN as torch's; ``error_if_nonfinite=True`` raises saying so and how to go on."""
    model = _model(pg)
    model["inp"].bias.grad[0] = math.nan
    ref = _copies(model)
    got = spmdmoe.clip_grad_norm_(model, 1.0, norm_type)
    want = torch.nn.utils.clip_grad_norm_(ref, 1.0, norm_type)
    assert got.isnan() and want.isnan()
    with pytest.raises(RuntimeError, match=r"expected a finite total gradient norm .* found nan .*error_if_nonfinite=False"):
        spmdmoe.clip_grad_norm_(model, 1.0, norm_type, error_if_nonfinite=True)


@pytest.mark.parametrize("norm_type", [0, -1.0, -math.inf, math.nan])
def test_rejects_other_norm_types(pg, norm_type):
    with pytest.raises(ValueError, match="expected norm_type a positive number or inf"):
        spmdmoe.clip_grad_norm_(_model(pg), 1.0, norm_type)
