"""``opt.state`` on W ranks: every trainable parameter has an entry; the owned coordinates'
moments are views of the rank's shard (in the parameter's shape when it owns all of them,
1-D with ``"owned"`` when the shard's edge cuts the parameter), and together the ranks cover
every coordinate exactly once."""

from __future__ import annotations

import pytest
import torch
from dist import run_ranks

import scape

SHAPES = [(300,), (37, 19), (5, 7, 11), (900,)]


def _body(rank: int, world: int) -> list[list[tuple[int, int]]]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    opt = scape.SCAPE(params, lr=1e-3, sparsity=0.9, block_size=256, warmup_steps=2)
    for t in range(4):
        g = torch.Generator().manual_seed(t + 10 * rank)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    assert len(opt.state) == len(params)
    b, s = opt.buckets[0], opt.shards[0]
    covered = []
    for p, o, n in zip(params, b.offsets, b.numels):
        st = opt.state[p]
        assert st["residual"].shape == p.shape
        assert st["residual"].data_ptr() == b.grad_flat[o:].data_ptr()
        if "exp_avg" not in st:
            covered.append((0, 0))
            continue
        lo, hi = st.get("owned", (0, n))
        if "owned" not in st:
            assert st["exp_avg"].shape == p.shape
        m = st["exp_avg"].reshape(-1)
        want = s.m[o + lo - b.shard_start:o + hi - b.shard_start]
        assert torch.equal(m, want) and m.data_ptr() == want.data_ptr()
        assert torch.equal(st["master"].reshape(-1), s.master[o + lo - b.shard_start:
                                                               o + hi - b.shard_start])
        covered.append((lo, hi))
    return covered


def test_state_views_cover_every_coordinate_once():
    res = run_ranks(_body, 2, timeout=120)
    for i, shape in enumerate(SHAPES):
        n = torch.Size(shape).numel()
        spans = sorted(r[i] for r in res if r[i] != (0, 0))
        assert spans[0][0] == 0 and spans[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # no gap, no overlap
    assert any(r[i] not in ((0, 0), (0, torch.Size(s).numel()))
               for r in res for i, s in enumerate(SHAPES))  # some parameter is cut


def _two(shapes: list[tuple[int, ...]]) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(3)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def test_checkpoint_of_another_layout_is_refused(tmp_path):
    """A checkpoint file of parameters with other shapes but the same sizes (here the two
    parameters in the other order) is refused by ``load_checkpoint`` before anything is
    loaded, naming the shapes; the live parameters and state are unchanged."""
    saved = _two([(40, 24), (6, 40)])
    opt = scape.SCAPE(saved, lr=1e-3, sparsity=0.9, block_size=256, warmup_steps=1)
    for p in saved:
        p.grad = torch.ones_like(p)
    opt.step()
    scape.save_checkpoint(opt, tmp_path / "ckpt")
    live = _two([(6, 40), (40, 24)])
    other = scape.SCAPE(live, lr=1e-3, sparsity=0.9, block_size=256, warmup_steps=1)
    before = [p.detach().clone() for p in live] + [other.shards[0].master.clone()]
    with pytest.raises(scape.CheckpointError, match="shapes"):
        scape.load_checkpoint(other, tmp_path / "ckpt")
    after = [p.detach() for p in live] + [other.shards[0].master]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
