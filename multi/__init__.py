"""Composite tier (``TieredConnector``) and its cost model (:mod:`multi.policy`,
:mod:`multi.calibration`); the router behind ``mctier proxy`` (:mod:`multi.router`) and the
``mctier`` command line (:mod:`multi.cli`) are packages of their own.

``TieredConnector`` is exported lazily so that the CLI imports without vLLM.
"""

__all__ = ["TieredConnector"]


def __getattr__(name: str):
    if name == "TieredConnector":
        from multi.connector import TieredConnector

        return TieredConnector
    raise AttributeError(f"module 'multi' has no attribute {name!r}")
