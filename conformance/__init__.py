"""The .s4w v1 conformance suite: frozen vectors (``v1/``), their generator and the reference
adapter for the external reader protocol (see ``README.md``)."""
