"""torch.optim behaviours that users rely on, run against every optimizer of the library side by
side with ``torch.optim.AdamW`` as the control (one process; the default communicator is then
a single rank). A new behaviour is one function in :data:`BEHAVIOURS`."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable

import pytest
import torch

import scape


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


BUILDERS: dict[str, Callable[[torch.nn.Module], torch.optim.Optimizer]] = {
    "AdamW": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
    "SCAPE": lambda m: scape.SCAPE(m.parameters(), lr=1e-3, block_size=256, warmup_steps=1),
    "DistributedAdamW": lambda m: scape.DistributedAdamW(m.parameters(), lr=1e-3),
    "SparseLoCo": lambda m: scape.SparseLoCo(
        m.parameters(), torch.optim.AdamW(m.parameters(), lr=1e-3), sync_every=2,
        block_size=256),
    "DiLoCo": lambda m: scape.DiLoCo(
        m.parameters(), torch.optim.AdamW(m.parameters(), lr=1e-3), sync_every=2),
}


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int = 3) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=g)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def state_dict_hooks_run(name: str) -> None:
    """``register_state_dict_{pre,post}_hook`` and ``register_load_state_dict_{pre,post}_hook``
    run, in torch's order, and a post hook's returned dict is the result."""
    model = _model()
    opt = BUILDERS[name](model)
    _train(model, opt)
    calls: list[str] = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("pre"))

    def post(o, sd):
        calls.append("post")
        return {**sd, "tag": 1}

    opt.register_state_dict_post_hook(post)
    sd = opt.state_dict()
    assert sd["tag"] == 1 and calls == ["pre", "post"]

    def load_pre(o, sd):
        calls.append("load_pre")
        return {k: v for k, v in sd.items() if k != "tag"}

    opt.register_load_state_dict_pre_hook(load_pre)
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load_post"))
    opt.load_state_dict(sd)
    assert calls == ["pre", "post", "load_pre", "load_post"]


def copy_works_or_refuses_at_once(name: str) -> None:
    """``copy.deepcopy`` and ``pickle`` either give an optimizer that steps, or raise at copy
    time with a message that names what to do instead (never a failure at a later step)."""
    model = _model()
    opt = BUILDERS[name](model)
    _train(model, opt)
    for copier in (copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o))):
        try:
            other = copier(opt)
        except TypeError as e:
            assert "state_dict" in str(e), str(e)
            continue
        _train(model, other, 1)


BEHAVIOURS = [state_dict_hooks_run, copy_works_or_refuses_at_once]


@pytest.mark.parametrize("name", list(BUILDERS))
@pytest.mark.parametrize("behaviour", BEHAVIOURS, ids=lambda f: f.__name__)
def test_behaves_like_torch_optim(behaviour, name):
    behaviour(name)
