"""bench.research.rotate: the transform-domain reparametrization of the quality research."""

from __future__ import annotations

import math

import pytest
import torch

from bench.research.rotate import TRANSFORMS, Rotated, transform_matrix


@pytest.mark.parametrize("kind", TRANSFORMS)
@pytest.mark.parametrize("c", [8, 64])
def test_transform_is_orthonormal(kind, c):
    d = transform_matrix(kind, c).double()
    assert d.shape == (c, c) and d.dtype == torch.float64
    assert torch.allclose(d @ d.T, torch.eye(c, dtype=torch.float64), atol=1e-6)


def test_dct_maps_a_cosine_to_one_coefficient():
    """DCT-II basis k is cos(pi (n + 1/2) k / c): the transform of it is a multiple of e_k."""
    c = 16
    d = transform_matrix("dct", c).double()
    n = torch.arange(c, dtype=torch.float64)
    for k in range(c):
        coef = d @ torch.cos(math.pi * (n + 0.5) * k / c)
        others = torch.cat([coef[:k], coef[k + 1:]])
        assert coef[k].abs() > 1.0 and others.abs().max() < 1e-6, (k, coef)


def test_hadamard_entries_are_plus_minus_one_over_sqrt_c():
    d = transform_matrix("hadamard", 32)
    assert torch.allclose(d.abs(), torch.full_like(d, 32 ** -0.5))


@pytest.mark.parametrize("args, match", [
    (("fft", 8), "transform must be one of"),
    (("dct", 1), "chunk must be an int >= 2"),
    (("dct", 8.0), "chunk must be an int >= 2"),
    (("hadamard", 12), "power-of-two chunk"),
])
def test_transform_rejects_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        transform_matrix(*args)


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(4, 16, generator=g)),
            torch.nn.Parameter(torch.randn(32, generator=g))]


def test_rotated_round_trip_and_grad_accumulation():
    ps = _params(0)
    before = [p.detach().clone() for p in ps]
    rot = Rotated(ps, "dct", 16)
    with torch.no_grad():
        for p in ps:
            p.fill_(float("nan"))  # pull must overwrite every entry
    rot.pull()
    for p, b in zip(ps, before):
        assert torch.allclose(p, b, atol=1e-6)
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(p.shape, generator=g) for p in ps]
    residual = [torch.randn(s.shape, generator=g) for s in rot.shadows]
    for s, r in zip(rot.shadows, residual):
        s.grad = r.clone()  # the optimizer's view (gradient + residual): never written
    views = [s.grad for s in rot.shadows]
    for p, gr in zip(ps, grads):
        p.grad = gr.clone()
    rot.push_grads()
    for p, gr in zip(ps, grads):  # a second micro-batch before the step: summed here
        p.grad = 2 * gr
    rot.push_grads()
    d = transform_matrix("dct", 16)
    for p, s, gr, r, view in zip(ps, rot.shadows, grads, residual, views):
        assert p.grad is None
        assert torch.equal(view, r), "the optimizer's buffer was written in place"
        expect = 3 * (gr.reshape(-1, 16) @ d.T).reshape(-1)  # the optimizer adds it to r
        assert s.grad is not view and torch.allclose(s.grad, expect, atol=1e-5)
    with pytest.raises(ValueError, match="not a multiple of the transform chunk 16"):
        Rotated([torch.nn.Parameter(torch.zeros(10))], "dct", 16)


@pytest.mark.parametrize("kind", TRANSFORMS)
def test_sgd_is_rotation_invariant(kind):
    """SGD commutes with an orthogonal map: training the shadows and pulling equals training
    the parameters (so the gradient mapping is right; AdamS's per-coordinate normalization
    is what the rotation changes)."""
    torch.manual_seed(0)
    x, y = torch.randn(32, 16), torch.randn(32, 4)
    plain = torch.nn.Linear(16, 4, bias=False)
    rotated = torch.nn.Linear(16, 4, bias=False)
    rotated.load_state_dict(plain.state_dict())
    start = plain.weight.detach().clone()
    rot = Rotated([rotated.weight], kind, 8)
    opt_a = torch.optim.SGD(plain.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(rot.shadows, lr=0.1)
    for _ in range(5):
        for model, opt in ((plain, opt_a), (rotated, opt_b)):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            if model is rotated:
                rot.push_grads()
            opt.step()
            if model is rotated:
                rot.pull()
    assert torch.allclose(plain.weight, rotated.weight, atol=1e-5)
    assert (plain.weight - start).abs().max() > 1e-3  # it trained
