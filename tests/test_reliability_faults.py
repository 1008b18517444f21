"""Promises 1 and 2 (issue 6): a peer that dies (os._exit, SIGKILL) or hangs during a phase of a
step makes every surviving rank raise ``CommError`` naming the op and the step, within the
configured timeout plus a margin, and exit non-zero; no rank hangs, none applies a half step.

Every case runs real gloo processes under an outer deadline. Each rank first trains a healthy
twin of the model in the same process group (the reference for "a whole step"), then builds
the optimizer under test and installs the fault on it (``scape.faults.install``, the one
fault-injection hook).
"""

from __future__ import annotations

import pytest
import torch
from dist import run_ranks_outcomes
from reliability_common import (
    FAULT_ENV,
    Clock,
    differing,
    env_faults,
    make_model,
    make_opt,
    snapshot,
    train_step,
)

from scape import faults

TIMEOUT_S = 3.0   # the communicator's timeout
PG_TIMEOUT_S = 9.0  # the process group's timeout: what bounds a gloo reduce-scatter (below)
MARGIN_S = 8.0    # detection and scheduling slack on a loaded 2-core machine
SAFE = ("params", "master", ".m", "age", "mask_current", "mask_next")


def _fault_body(rank, world, spec, fault_step, expect_step, bound_s):
    from scape.comm import CommError, TorchCommunicator

    fault = faults.parse(spec)[0]
    ref_model = make_model()
    ref_opt = make_opt(ref_model, TorchCommunicator(timeout=TIMEOUT_S))
    ref = {}
    for t in range(1, fault_step + 1):
        train_step(ref_model, ref_opt, t, rank)
        ref[t] = snapshot(ref_opt)

    model = make_model()
    opt = make_opt(model, TorchCommunicator(timeout=TIMEOUT_S))
    assert faults.install(opt, spec) is None
    assert (opt._faults is not None) == (rank == fault.rank)
    good = None
    for t in range(1, fault_step + 3):
        before = snapshot(opt, wait=False)
        clock = Clock()
        try:
            train_step(model, opt, t, rank)
        except CommError as e:
            elapsed = clock()
            now = snapshot(opt, wait=False)
            assert elapsed <= bound_s + MARGIN_S, f"raised after {elapsed:.1f} s"
            if fault.kind == "hang":
                assert elapsed >= 0.9 * bound_s, f"timed out after only {elapsed:.1f} s"
            assert e.step == expect_step and f"step {expect_step}" in str(e), str(e)
            if fault.phase == "all_gather":
                # the update was whole: the shard equals the healthy run after this step
                bad = differing(ref[t], now, skip=("params", "residual", "mask_current",
                                                   "mask_next", "step"))
                assert not bad, f"shard after a failed all-gather differs from a whole step: {bad}"
                # a sparse bucket scatters only after its all-gather: its model part is
                # untouched (a dense bucket gathers into the model in place, so it may not be)
                if not opt.is_dense_step(t):
                    assert torch.equal(before["0.params"], now["0.params"])
            else:
                keys = [k for k in before if k in now and k.endswith(SAFE)]
                bad = differing({k: before[k] for k in keys}, {k: now[k] for k in keys})
                assert not bad, f"state changed by a failed {fault.phase}: {bad}"
                if good is not None:  # and it is what the healthy run held before the step
                    assert not differing(good, {k: now[k] for k in good})
            for call in (lambda s=t + 1: train_step(model, opt, s, rank), opt.state_dict):
                try:
                    call()
                except RuntimeError as refusal:
                    assert "unusable after a failed collective" in str(refusal)
                else:
                    raise AssertionError("a failed optimizer accepted another call")
            raise
        good = {k: v for k, v in ref[t].items()
                if k.endswith(("master", ".m", "age"))} if t in ref else None
    raise AssertionError(f"rank {rank}: no CommError through step {fault_step + 2}")


CASES = [
    # (world, fault spec, op the survivors name, step they name)
    pytest.param(3, "2:7:reduce_scatter:die", "reduce_scatter", 7, id="die-reduce_scatter-W3"),
    pytest.param(2, "1:7:all_reduce:kill", "all_reduce", 7, id="sigkill-all_reduce"),
    pytest.param(2, "1:7:all_gather:die", "all_gather", 7, id="die-all_gather-sparse"),
    pytest.param(2, "0:5:all_gather:die", "all_gather", 5, id="die-all_gather-dense"),
    # killed before issuing the mask all-gather of step 5, a dense refresh (a sparse step's
    # next mask rides with its parameter all-gather): step 5 completes, step 6 finds it missing
    pytest.param(2, "1:5:mask_sync:die", "all_gather", 5, id="die-mask_sync"),
    # killed after step 6's all-gathers (values and the next mask in one): step 7 fails first
    pytest.param(2, "1:6:mask_sync:die", "reduce_scatter", 7, id="die-after-sparse-all_gather"),
    pytest.param(2, "1:7:all_reduce:hang=7", "all_reduce", 7, id="hang-all_reduce"),
    # torch's gloo reduce-scatter work ignores wait(timeout): the process group's timeout
    # bounds it instead (PG_TIMEOUT_S), so the peer sleeps past that
    pytest.param(2, "1:7:reduce_scatter:hang=13", "reduce_scatter", 7,
                 id="hang-reduce_scatter"),
]


@pytest.mark.parametrize("world,spec,op,step", CASES)
def test_peer_fault_raises_comm_error_on_survivors(world, spec, op, step):
    fault = faults.parse(spec)[0]
    bound = PG_TIMEOUT_S if fault.kind == "hang" and fault.phase == "reduce_scatter" \
        else TIMEOUT_S
    outcomes = run_ranks_outcomes(_fault_body, world, spec, fault.step, step, bound,
                                  timeout=150, pg_timeout=PG_TIMEOUT_S)
    faulty = outcomes[fault.rank]
    assert not faulty.ok and faulty.exitcode != 0, faulty
    if fault.kind == "die":
        assert faulty.exitcode == faults.DIE_EXIT_CODE, faulty
    if fault.kind == "kill":
        assert faulty.exitcode == -9, faulty
    for o in outcomes:
        if o.rank == fault.rank:
            continue
        assert o.exc_type == "CommError" and o.exitcode == 1, (o.rank, o.exc_type, o.error)
        assert f"{op} failed on rank {o.rank}, step {step}" in o.error, o.error


# --------------------------------------------------------------------------- the hook itself
def test_fault_spec_parsing_and_validation():
    fs = faults.parse("1:5:reduce_scatter:die, 0:3:grad:nan=17,2:9:save:hang=2.5")
    assert [(f.rank, f.step, f.phase, f.kind, f.arg) for f in fs] == [
        (1, 5, "reduce_scatter", "die", None), (0, 3, "grad", "nan", 17.0),
        (2, 9, "save", "hang", 2.5)]
    bad = {"1:5:reduce_scatter": "RANK:STEP:PHASE:KIND", "x:5:grad:die": "integers",
           "1:0:grad:die": "STEP >= 1", "1:5:forward:die": "phase 'forward'",
           "1:5:grad:explode": "kind 'explode'", "1:5:all_gather:nan": "needs phase 'grad'",
           "1:5:grad:hang=soon": "ARG a number"}
    for text, words in bad.items():
        with pytest.raises(ValueError, match="Invalid fault") as info:
            faults.parse(text)
        assert words in str(info.value) and text.split(",")[0] in str(info.value)
    # one rank's faults
    assert [f.rank for f in faults.parse("1:5:grad:die,0:2:grad:die", 1)] == [1]
    assert faults.parse("1:5:grad:die", 0) == []


def test_fault_plan_from_env():
    """What the torchrun script arms from ``SCAPE_FAULT`` (tests/reliability_common.py)."""
    assert env_faults(0, {}) == []
    assert env_faults(0, {FAULT_ENV: "  "}) == []
    assert env_faults(0, {FAULT_ENV: "1:5:grad:die"}) == []  # not this rank
    plan = env_faults(1, {FAULT_ENV: "1:5:grad:die,0:2:grad:die"})
    assert [f.rank for f in plan] == [1]
    # a restarted elastic job runs clean
    assert env_faults(1, {FAULT_ENV: "1:5:grad:die", "TORCHELASTIC_RESTART_COUNT": "1"}) == []
    assert env_faults(1, {FAULT_ENV: "1:5:grad:die",
                          "TORCHELASTIC_RESTART_COUNT": "0"}) != []


def test_hook_uninstalled_costs_nothing_and_bad_spec_raises_at_install(monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "0:1:grad:nan=1")  # the library never reads it
    model = make_model()
    opt = make_opt(model)
    assert opt._faults is None
    train_step(model, opt, 1, 0)
    assert not opt.last_step.skipped
    model = make_model()
    opt = make_opt(model)
    assert faults.install(opt, "0:2:grad:nan=1") is None
    assert opt._faults is not None
    train_step(model, opt, 1, 0)
    assert not opt.last_step.skipped
    train_step(model, opt, 2, 0)
    assert opt.last_step.skipped  # the NaN written at step 2 made the step skip
    armed = opt._faults
    with pytest.raises(ValueError, match="fault kind 'boom'"):
        faults.install(opt, "0:2:grad:boom")
    assert opt._faults is armed  # a bad spec changes nothing
    assert faults.install(opt, "1:3:grad:die") is armed and opt._faults is None  # not rank 0
    # inside `inject` only: the NaN at step 3 skips it, step 4 runs clean
    with faults.inject(opt, "0:3:grad:inf") as plan:
        assert plan is not None and opt._faults is plan
        train_step(model, opt, 3, 0)
    assert opt.last_step.skipped and opt._faults is None
    assert faults.uninstall(opt) is None
    train_step(model, opt, 4, 0)
    assert not opt.last_step.skipped
    with pytest.raises(TypeError, match="no fault hook"):
        faults.install(torch.optim.SGD(make_model().parameters(), lr=0.1), "0:1:grad:die")
