"""Communication layer (imported as ``scape.comm``)."""
