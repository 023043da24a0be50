"""Composite tier (``TieredConnector``) and the ``mctier`` command line.

``TieredConnector`` is exported lazily so that the CLI imports without vLLM.
"""

__all__ = ["TieredConnector"]


def __getattr__(name: str):
    if name == "TieredConnector":
        from multi.connector import TieredConnector

        return TieredConnector
    raise AttributeError(f"module 'multi' has no attribute {name!r}")
