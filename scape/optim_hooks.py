"""What every ``torch.optim.Optimizer`` does around its state that the library's optimizers
do too: the state-dict hooks run (``register_state_dict_{pre,post}_hook``,
``register_load_state_dict_{pre,post}_hook``, in torch's order and with torch's return
conventions), and copying refuses at once with what to do instead.

The library's optimizers own flat buffers that alias the model's parameters and a
communicator bound to a process group: a copy would step buffers no model reads. torch.optim's
own ``__getstate__`` keeps only ``defaults``, ``state`` and ``param_groups``, so without
:func:`refuse_copy` a copy fails at its first ``step()`` instead.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def state_dict_hooks(fn: F) -> F:
    """Wrap an optimizer's ``state_dict``: pre hooks ``hook(opt)`` first; post hooks
    ``hook(opt, state_dict)`` last, each may return a new state dict."""

    @functools.wraps(fn)
    def wrapper(self: Any) -> Any:
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        state = fn(self)
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, state)
            if result is not None:
                state = result
        return state

    return wrapper  # type: ignore[return-value]


def load_state_dict_hooks(fn: F) -> F:
    """Wrap an optimizer's ``load_state_dict``: pre hooks ``hook(opt, state_dict)`` first,
    each may return the state dict to load instead; post hooks ``hook(opt)`` after."""

    @functools.wraps(fn)
    def wrapper(self: Any, state_dict: Any) -> None:
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        fn(self, state_dict)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    return wrapper  # type: ignore[return-value]


def refuse_copy(self: Any) -> Any:
    """``__getstate__`` of the library's optimizers: ``copy.deepcopy`` and ``pickle`` raise
    ``TypeError`` at copy time."""
    name = type(self).__name__
    raise TypeError(f"{name} cannot be copied or pickled: it owns flat buffers that alias the "
                    "model's parameters and a communicator bound to a process group. Save "
                    f"opt.state_dict() (or scape.save_checkpoint), build a new {name} over the "
                    "parameters it should train, and load_state_dict into it")
