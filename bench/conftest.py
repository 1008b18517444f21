"""Collect ``bench_*.py`` files as test modules, so ``pytest bench/ --benchmark-only`` runs
the micro-benchmarks (the project's default test paths stay ``tests/``)."""

from __future__ import annotations

import pytest


def pytest_collect_file(parent, file_path):
    if (file_path.suffix == ".py" and file_path.name.startswith("bench_")
            and not parent.session.isinitpath(file_path)):
        return pytest.Module.from_parent(parent, path=file_path)
    return None


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Print the bytes / bandwidth / copy-ratio columns that pytest-benchmark's own table
    leaves out (they live in each benchmark's ``extra_info``)."""
    session = getattr(config, "_benchmarksession", None)
    rows = [b for b in getattr(session, "benchmarks", []) if b.extra_info.get("GB/s")]
    if not rows:
        return
    keys = ["bytes", "GB/s", "copy GB/s", "vs copy", "Melem/s", "torch.topk s", "vs torch.topk"]
    cells = [["benchmark", "min ms", *keys]]
    for b in rows:
        cells.append([b.name, f"{b.stats.min * 1e3:.3f}",
                      *[str(b.extra_info.get(k, "")) for k in keys]])
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    terminalreporter.write_sep("-", "bytes moved and bandwidth (vs copy: copy time / op time)")
    for r in cells:
        terminalreporter.write_line("  ".join(c.ljust(w) for c, w in zip(r, widths)))
