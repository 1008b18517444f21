"""The research side of SCAPE: rules and schedules that are not part of the library's product
surface. Everything here plugs into ``scape`` through its public API (``scape.rules.register``,
the optimizer's public attributes); the library imports nothing from here.

``import bench.research.rules`` registers every research rule under its name, so
``scape.SCAPE(..., update="catchup_agree_trust2_accum")`` works afterwards (docs/research.md).
"""
