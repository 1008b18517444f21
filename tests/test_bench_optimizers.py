"""bench.engine.optimizers: the one table the benchmarks build their optimizers from, the rule
names it takes once a module registered them, and the keyword arguments it refuses with what
replaces them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from bench.engine.nullcomm import NullCommunicator
from bench.engine.optimizers import (
    LOCAL_STEPS,
    OPTIMIZERS,
    REMOVED_KWARGS,
    Spec,
    build,
    check_kwargs,
)
from bench.engine.run_config import RunConfig
from bench.workloads.gpt import GPT, get_config, param_groups

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _spec(name: str) -> Spec:
    entry = OPTIMIZERS[name]
    kwargs: dict = {"warmup_steps": 1} if entry.sparse else {}
    if entry.local_steps:
        kwargs = {"sync_every": 1}
    return Spec(lr=1e-3, betas=(0.9, 0.95), sparsity=0.9 if entry.sparse else 0.0,
                kwargs=kwargs)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_entry_builds_and_trains_a_step(name):
    model = GPT(get_config("tiny"), seed=0)
    groups = param_groups(model, 0.1)
    for g in groups:
        g.pop("name")
    comm = None if OPTIMIZERS[name].comm == "ddp" else NullCommunicator(1, 0)
    opt = build(name, groups, _spec(name), comm)
    assert isinstance(opt, torch.optim.Optimizer)
    assert [g["lr"] for g in opt.param_groups] == [1e-3] * len(opt.param_groups)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    for step in range(2):  # one dense warm-up step, then a sparse one
        before = [p.detach().clone() for p in model.parameters()]
        model.loss(x, x).backward()
        opt.step()
        opt.zero_grad()
        assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters())), name
        if OPTIMIZERS[name].sparse:
            assert opt.last_step.dense == (step == 0)


def test_table_traits():
    assert set(OPTIMIZERS) == {"adamw_ddp", "hsdp_adamw", "dist_adamw", "adams", "scape",
                               "topk", "compute_only", "sparseloco", "diloco"}
    assert LOCAL_STEPS == ("sparseloco", "diloco")
    assert [n for n, e in OPTIMIZERS.items() if e.sparse] == ["scape", "topk", "compute_only"]
    assert [n for n, e in OPTIMIZERS.items() if e.group_sparsity] == ["scape", "compute_only"]
    assert {n: e.comm for n, e in OPTIMIZERS.items() if e.comm != "torch"} == {
        "adamw_ddp": "ddp", "hsdp_adamw": "hsdp", "compute_only": "null"}


@pytest.mark.parametrize("key", list(REMOVED_KWARGS))
def test_removed_keywords_are_refused_with_the_replacement(key):
    with pytest.raises(ValueError, match=f"optimizer_kwargs\\['{key}'\\] of 'scape'"):
        check_kwargs("scape", {key: 0.2})
    with pytest.raises(ValueError, match="RunConfig.optimizer_kwargs") as info:
        RunConfig(optimizer="scape", optimizer_kwargs={key: 0.2})
    assert ("register a rule" in str(info.value)) == (key in ("explore", "error_feedback"))
    check_kwargs("sparseloco", {"sync_every": 2})  # other optimizers' own keywords pass
    with pytest.raises(ValueError, match="unknown optimizer 'sgd'"):
        check_kwargs("sgd", {})


def test_research_rule_names_build_in_a_fresh_process():
    """A rank of the runner never called ``with_options``: once ``bench.research`` is imported
    (a ``RunConfig.imports`` entry), the option rules of its table (``OPTION_RULES``) are
    registered by name, as every research rule is; the optimizer table alone knows neither."""
    code = (
        "import torch\n"
        "from bench.engine.optimizers import Spec, build, check_rule\n"
        "import scape\n"
        "assert 'catchup_snr_accum' not in scape.rules.RULES\n"
        "try:\n"
        "    check_rule('catchup_snr_accum')\n"
        "except ValueError:\n"
        "    pass\n"
        "else:\n"
        "    raise AssertionError('a research rule without the research')\n"
        "import bench.research\n"
        "p = [torch.nn.Parameter(torch.zeros(4096))]\n"
        "for update in ('catchup_agree_trust2_accum-explore0.2-noef', 'catchup_snr_accum'):\n"
        "    opt = build('scape', p, Spec(lr=1e-3, sparsity=0.9, kwargs={'update': update}))\n"
        "    print(opt.update, opt.explore, opt.error_feedback)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == [
        "catchup_agree_trust2_accum-explore0.2-noef 0.2 False", "catchup_snr_accum 0.1 True"]


def test_unknown_rule_names_reach_the_optimizer():
    with pytest.raises(ValueError, match="Invalid update rule: 'lazy-explore2'"):
        build("scape", [torch.nn.Parameter(torch.zeros(4096))],
              Spec(lr=1e-3, sparsity=0.9, kwargs={"update": "lazy-explore2"}))


def test_link_delay_is_checked():
    assert RunConfig(optimizer="scape", sparsity=0.99, link_delay_ms=10).link_delay_ms == 10
    for bad in (-1.0, 20_000.0, True, "10ms"):
        with pytest.raises(ValueError, match="RunConfig.link_delay_ms"):
            RunConfig(optimizer="scape", sparsity=0.99, link_delay_ms=bad)
    with pytest.raises(ValueError, match="RunConfig.link_delay_ms models one flat group"):
        RunConfig(optimizer="scape", sparsity=0.99, link_delay_ms=10, world=4, nodes=2,
                  two_level=True)


def test_wire8_rows_build_both_wires():
    spec = Spec(lr=1e-3, sparsity=0.99, kwargs={"grad_comm_dtype": "int8",
                                                "param_comm_dtype": "int8"})
    p = torch.nn.Parameter(torch.randn(4096))
    opt = build("scape", [{"params": [p]}], spec, NullCommunicator(1, 0))
    assert opt.grad_comm_dtype == torch.int8 and opt.param_comm_dtype == torch.int8
    with pytest.raises(ValueError, match="param_comm_dtype.*not a torch dtype"):
        build("scape", [{"params": [p]}], Spec(lr=1e-3, sparsity=0.99, kwargs={
            "param_comm_dtype": "int9"}), NullCommunicator(1, 0))
