"""P2P tier: prefill -> decode KV handoff over the Mooncake Transfer Engine.

``{"kv_connector": "P2PConnector", "kv_connector_module_path": "p2p", ...}``. The
connector class is exported lazily so that light submodules (protocol, bootstrap,
proxy) never import vLLM.
"""

__all__ = ["P2PConnector"]


def __getattr__(name: str):
    if name == "P2PConnector":
        from p2p.connector import P2PConnector

        return P2PConnector
    raise AttributeError(f"module 'p2p' has no attribute {name!r}")
