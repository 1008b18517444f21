"""SCAPE: sparse, communication-efficient sharded AdamS for data-parallel pre-training."""

__version__ = "0.1.0"
