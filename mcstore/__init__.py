"""Store tier: prefix reuse on Mooncake Store.

``StoreConnector`` is exported lazily so that light submodules (keys, config,
server) import without vLLM.
"""

__all__ = ["StoreConnector"]


def __getattr__(name: str):
    if name == "StoreConnector":
        from mcstore.connector import StoreConnector

        return StoreConnector
    raise AttributeError(f"module 'mcstore' has no attribute {name!r}")
