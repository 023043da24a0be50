"""Composite tier (``TieredConnector``) and its cost model (:mod:`multi.policy`,
:mod:`multi.calibration`); the router behind ``mctier proxy`` (:mod:`multi.router`) and the
``mctier`` command line (:mod:`multi.cli`) are packages of their own.

``TieredConnector`` and ``TieredHMAConnector`` (the same composite declaring vLLM's
``SupportsHMA``: :mod:`multi.connector`) are exported lazily so that the CLI imports without vLLM.
"""

__all__ = ["TieredConnector", "TieredHMAConnector"]


def __getattr__(name: str):
    if name in __all__:
        import multi.connector

        return getattr(multi.connector, name)
    raise AttributeError(f"module 'multi' has no attribute {name!r}")
