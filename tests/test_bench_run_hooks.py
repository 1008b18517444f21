"""The engine's two extension points that the research (or any package) plugs into without the
engine naming it: ``RunConfig.imports`` (modules imported before validation, in the parent and in
every rank; :data:`bench.engine.run_config.PLUGINS` their default) and ``RunConfig.hooks``
(``"module:factory"`` step hooks, with an optional ``check`` before launch), and
:data:`bench.engine.optimizers.RULE_NAMES`."""

from __future__ import annotations

import sys

import pytest
import torch

from bench.engine import optimizers, run_config
from bench.engine.run_config import RunConfig, hook_factory

PLUGIN = '''
import scape
from bench.engine import optimizers

LOADS = []
LOADS.append(1)
if "test-plugin-rule" not in scape.rules.RULES:
    scape.rules.register("test-plugin-rule", scape.rules.get("lazy"))


def alias(name):
    return "test-plugin-rule" if name == "plugin-alias" else name


optimizers.RULE_NAMES.append(alias)


class Hook:
    CHECKED = []

    def __init__(self, cfg, module, opt, every=1):
        self.every = every

    @staticmethod
    def check(cfg, every=1):
        if every < 1:
            raise ValueError("every must be >= 1")
        Hook.CHECKED.append(every)
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    (tmp_path / "bench_test_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    before = list(optimizers.RULE_NAMES)
    yield "bench_test_plugin"
    optimizers.RULE_NAMES[:] = before
    sys.modules.pop("bench_test_plugin", None)


def test_imports_load_a_module_before_the_run_is_validated(plugin):
    assert plugin not in sys.modules
    cfg = RunConfig(imports=[plugin], optimizer_kwargs={"update": "test-plugin-rule"})
    assert sys.modules[plugin].LOADS == [1] and cfg.imports == [plugin]
    optimizers.check_rule("plugin-alias")  # the module's RULE_NAMES entry
    opt = optimizers.build("scape", [torch.nn.Parameter(torch.zeros(4096))],
                           optimizers.Spec(lr=1e-3, sparsity=0.9,
                                           kwargs={"update": "plugin-alias"}))
    assert opt.update == "test-plugin-rule"
    with pytest.raises(ModuleNotFoundError):
        RunConfig(imports=["bench_no_such_module"])
    with pytest.raises(TypeError, match="list of module names"):
        RunConfig(imports="bench_test_plugin")  # type: ignore[arg-type]


def test_hooks_are_checked_before_launch(plugin):
    cfg = RunConfig(hooks={f"{plugin}:Hook": {"every": 3}})
    assert sys.modules[plugin].Hook.CHECKED == [3]
    assert hook_factory(f"{plugin}:Hook") is sys.modules[plugin].Hook
    assert run_config.RunConfig.from_dict(
        {k: getattr(cfg, k) for k in ("hooks", "steps")}).imports == []
    with pytest.raises(ValueError, match="every must be"):
        RunConfig(hooks={f"{plugin}:Hook": {"every": 0}})
    for bad in ("bench_test_plugin", f"{plugin}:Nope", "bench_no_such_module:f", ":f"):
        with pytest.raises(ValueError, match="RunConfig.hooks"):
            RunConfig(hooks={bad: {}})
    with pytest.raises(TypeError, match="dict of keyword arguments"):
        RunConfig(hooks={f"{plugin}:Hook": [3]})  # type: ignore[dict-item]


def test_plugins_are_the_default_imports(monkeypatch):
    monkeypatch.setattr(run_config, "PLUGINS", ["json"])
    assert RunConfig().imports == ["json"]
    assert RunConfig.from_dict({}).imports == []  # a config as written names its own


RECORDER = '''
class Recorder:
    """Records when the loop calls it; splits the one group in two through param_groups."""

    def __init__(self, cfg, module, opt, tag="r"):
        self.opt, self.calls = opt, []

    @staticmethod
    def param_groups(cfg, module, groups, tag="r"):
        (g,) = groups
        return [dict(g, params=[p for p in g["params"] if p.ndim == 2]),
                dict(g, params=[p for p in g["params"] if p.ndim != 2])]

    def before_step(self, step):
        self.calls.append(("before_step", step))

    def after_backward(self, step):
        grads = [p.grad for g in self.opt.param_groups for p in g["params"]]
        self.calls.append(("after_backward", step, all(g is not None for g in grads)))

    def after_step(self, step):
        self.calls.append(("after_step", step))

    def result(self):
        return {"calls": self.calls, "groups": len(self.opt.param_groups)}
'''


@pytest.mark.timeout(120)
def test_the_loop_calls_every_hook_point_in_order_on_one_rank(tmp_path, monkeypatch):
    """One rank (W=1) of the engine's loop on a workload of its own (``RunConfig.workload``):
    each hook's ``param_groups`` before the optimizer is built, then per step ``before_step``,
    ``after_backward`` (the gradients there, before ``opt.step()``), ``after_step``; its
    ``result()`` comes back under ``"hooks"``."""
    from bench.engine.runner import run

    (tmp_path / "bench_test_recorder.py").write_text(RECORDER)
    monkeypatch.syspath_prepend(str(tmp_path))
    res = run(RunConfig(optimizer="adams", sparsity=0.0, world=1, steps=3, eval_every=3,
                        workload="bench.research.lr_stability:Regression", one_group=True,
                        weight_decay=0.0, hooks={"bench_test_recorder:Recorder": {}},
                        threads=1, log_every=0, timeout_s=100.0, attach=False, imports=[]))
    calls = res["hooks"]["bench_test_recorder:Recorder"]["calls"]
    assert res["hooks"]["bench_test_recorder:Recorder"]["groups"] == 2
    assert calls == [c for s in range(3) for c in (("before_step", s),
                                                   ("after_backward", s, True),
                                                   ("after_step", s))]
    assert len(res["train_curve"]) == 3 and res["final_val_loss"] > 0
    assert [s for s, _ in res["val_curve"]] == [3]
    with pytest.raises(ValueError, match="RunConfig.workload"):
        RunConfig(workload="bench_no_such_module:W")
    with pytest.raises(TypeError, match="RunConfig.attach must be a bool"):
        RunConfig(attach=1)  # type: ignore[arg-type]
