"""What the forkserver of :mod:`bench.engine.launch` imports once, before it forks any rank:
torch and torch.distributed (the seconds a spawned rank spends importing them). Nothing of
SCAPE: its kernels read ``TRITON_INTERPRET`` and the rest of a rank's environment when a
rank imports them, after ``Ranks.env`` is set.

torch's import leaves a native thread in the server (the forked rank has only the forking
one, and torch has run no operation there); Python 3.12+ warns at every fork of a process
with threads, so the server ignores that one warning."""

import warnings

warnings.filterwarnings("ignore", message=r".*use of fork\(\) may lead to deadlocks",
                        category=DeprecationWarning)

import torch  # noqa: E402,F401
import torch.distributed  # noqa: E402,F401
