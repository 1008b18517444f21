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


class _Transposed(torch.nn.Module):
    """:func:`_model`'s parameters, each weight transposed: the same sizes, other shapes."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.w1 = torch.nn.Parameter(torch.randn(16, 32, generator=g) * 0.2)
        self.b1 = torch.nn.Parameter(torch.zeros(32))
        self.w2 = torch.nn.Parameter(torch.randn(32, 4, generator=g) * 0.2)
        self.b2 = torch.nn.Parameter(torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.w1 + self.b1) @ self.w2 + self.b2


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int = 3) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=g).to(next(model.parameters()).dtype)
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


def weights_written_after_construction_are_kept(name: str) -> None:
    """``model.load_state_dict(pretrained)`` after building the optimizer (the usual order for
    fine-tuning): the next step starts from the loaded weights, not from the old ones."""
    model = _model()
    opt = BUILDERS[name](model)
    _train(model, opt, 2)
    loaded = {k: torch.full_like(v, 0.25) for k, v in model.state_dict().items()}
    model.load_state_dict(loaded)
    for g in opt.param_groups:
        g["lr"] = 1e-9
    _train(model, opt, 1)
    for k, v in model.state_dict().items():
        assert (v - 0.25).abs().max() < 1e-4, (k, float((v - 0.25).abs().max()))


def unfrozen_parameter_trains_or_raises(name: str) -> None:
    """A parameter frozen when the optimizer was built and unfrozen later either trains or
    ``step()`` raises a ValueError that says what to do (never a silent no-op)."""
    model = _model()
    first = model[0].weight
    first.requires_grad_(False)
    opt = BUILDERS[name](model)
    first.requires_grad_(True)
    before = first.detach().clone()
    try:
        _train(model, opt, 3)
    except ValueError as e:
        assert "requires_grad" in str(e), str(e)
        return
    assert not torch.equal(first.detach(), before), "the unfrozen parameter never trained"


def second_optimizer_gets_gradients(name: str) -> None:
    """Building a second optimizer over the same (bf16) parameters after dropping the first:
    the second one trains them."""
    model = _model().to(torch.bfloat16)
    first = BUILDERS[name](model)
    _train(model, first, 1)
    del first
    opt = BUILDERS[name](model)
    before = [p.detach().clone() for p in model.parameters()]
    _train(model, opt, 3)
    moved = [not torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before)]
    assert all(moved), moved


def state_of_another_layout_is_refused(name: str) -> None:
    """A state dict saved for parameters of other shapes with the same total size raises on
    load, and changes nothing."""
    model = _model()
    opt = BUILDERS[name](model)
    _train(model, opt)
    other = _Transposed()
    assert [p.numel() for p in other.parameters()] == [p.numel() for p in model.parameters()]
    other_opt = BUILDERS[name](other)
    _train(other, other_opt)
    params = [p.detach().clone() for p in model.parameters()]
    sd = other_opt.state_dict()
    with pytest.raises((ValueError, KeyError, RuntimeError)):
        opt.load_state_dict(sd)
    assert all(torch.equal(p.detach(), q) for p, q in zip(model.parameters(), params))


def compiled_step_runs(name: str) -> None:
    """``torch.compile`` of a training step that calls ``opt.step()`` runs and trains like the
    eager step (dynamo may leave the optimizer step out of its graph)."""
    eager_model, compiled_model = _model(), _model()
    eager, compiled = BUILDERS[name](eager_model), BUILDERS[name](compiled_model)

    def train_step(model, opt, x):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    fn = torch.compile(train_step, backend="eager")
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        x = torch.randn(8, 16, generator=g)
        train_step(eager_model, eager, x)
        fn(compiled_model, compiled, x)
    for p, q in zip(eager_model.parameters(), compiled_model.parameters()):
        torch.testing.assert_close(p, q)


def grad_scaler_works_or_raises(name: str) -> None:
    """``torch.amp.GradScaler``: the scaled run (a power-of-two scale, so unscaling is exact)
    trains like the unscaled one, or the first ``scaler.step`` raises a ValueError saying what
    to use instead; also after an explicit ``scaler.unscale_`` (for clipping)."""
    plain_model, scaled_model = _model(), _model()
    plain, scaled = BUILDERS[name](plain_model), BUILDERS[name](scaled_model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4, growth_interval=1000)
    g = torch.Generator().manual_seed(4)
    for _ in range(8):
        x = torch.randn(8, 16, generator=g)
        plain_model(x).square().mean().backward()
        plain.step()
        plain.zero_grad()
        scaler.scale(scaled_model(x).square().mean()).backward()
        scaler.unscale_(scaled)
        try:
            scaler.step(scaled)
        except ValueError as e:
            assert "GradScaler" in str(e) and "bfloat16" in str(e), str(e)
            return
        scaler.update()
        scaled.zero_grad()
    for p, q in zip(plain_model.parameters(), scaled_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def state_holds_each_parameters_tensors(name: str) -> None:
    """``opt.state[p]`` for every trainable parameter, with ``exp_avg`` in the parameter's
    shape (one process owns every coordinate), a view that follows the optimizer."""
    model = _model()
    opt = BUILDERS[name](model)
    _train(model, opt)
    params = [p for p in model.parameters() if p.requires_grad]
    assert len(opt.state) == len(params)
    for p in params:
        st = opt.state[p]
        assert st["exp_avg"].shape == p.shape and bool(st["exp_avg"].any())
    before = opt.state[params[0]]["exp_avg"].clone()
    _train(model, opt, 2)
    assert not torch.equal(opt.state[params[0]]["exp_avg"], before)


def step_hooks_and_closure(name: str) -> None:
    """``register_step_pre_hook``/``register_step_post_hook`` run around ``step()``, and
    ``step(closure)`` evaluates the closure (with grad enabled) and returns its loss."""
    model = _model()
    opt = BUILDERS[name](model)
    calls: list[str] = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("pre"))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append("post"))
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(6))

    def closure():
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert calls == ["pre", "post"] and float(loss) > 0


def lr_scheduler_drives_the_lr(name: str) -> None:
    """A torch LR scheduler built on the optimizer changes the lr every step uses."""
    model = _model()
    opt = BUILDERS[name](model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 0.5 ** t)
    for t in range(3):
        _train(model, opt, 1)
        sched.step()
        assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * 0.5 ** (t + 1))


BEHAVIOURS = [state_dict_hooks_run, copy_works_or_refuses_at_once,
              weights_written_after_construction_are_kept, unfrozen_parameter_trains_or_raises,
              second_optimizer_gets_gradients, state_of_another_layout_is_refused,
              compiled_step_runs, grad_scaler_works_or_raises,
              state_holds_each_parameters_tensors, step_hooks_and_closure,
              lr_scheduler_drives_the_lr]


BEYOND_TORCH = {state_of_another_layout_is_refused}
"""Contracts of the library that torch.optim itself does not keep (AdamW loads the other
layout and fails at the next step; its control run would be meaningless)."""


@pytest.mark.parametrize("name", list(BUILDERS))
@pytest.mark.parametrize("behaviour", BEHAVIOURS, ids=lambda f: f.__name__)
def test_behaves_like_torch_optim(behaviour, name):
    if name == "AdamW" and behaviour in BEYOND_TORCH:
        pytest.skip("a contract of the library beyond torch.optim's")
    behaviour(name)
