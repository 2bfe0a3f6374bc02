"""The .s4w v1 conformance suites: frozen vectors (``v1/`` for format 1.0, ``v1.1/`` for what
1.1 adds), their generator and the reference adapter for the external reader protocol (see
``README.md``)."""
