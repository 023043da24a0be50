"""Loggers under vLLM's namespace, so vLLM's handlers and level apply to ours."""

from __future__ import annotations

import logging
import sys


def get_logger(name: str) -> logging.Logger:
    # vLLM only configures the "vllm" logger tree; a logger outside it prints nothing
    # inside the engine processes, so ours live under "vllm.mctier". Processes that
    # never imported vLLM (store server, proxy, tools) must not pay ~8 s to import it
    # just for a logger.
    full = f"vllm.mctier.{name}"
    if "vllm" in sys.modules:
        from vllm.logger import init_logger

        return init_logger(full)
    logger = logging.getLogger(full)
    if not logging.getLogger().handlers and not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    return logger
