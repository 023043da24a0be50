"""Loggers under vLLM's namespace, so vLLM's handlers and level apply to ours."""

from __future__ import annotations

import logging


def get_logger(name: str) -> logging.Logger:
    # vLLM only configures the "vllm" logger tree; a logger outside it prints nothing
    # inside the engine processes, so ours live under "vllm.mctier".
    full = f"vllm.mctier.{name}"
    try:
        from vllm.logger import init_logger
    except ImportError:
        return logging.getLogger(full)
    return init_logger(full)
