"""Triton kernels with torch reference implementations (imported as ``scape.kernels``)."""
