"""Prompt token ids for the router's index, as the engines will see them.

- ``/v1/completions`` with ``prompt`` a list of token ids: those ids;
- ``prompt`` a string: the served model's tokenizer (special tokens added, as vLLM's
  OpenAI server does); ``/v1/chat/completions``: its chat template with the generation
  prompt;
- the tokenizer is loaded once from ``tokenizer`` (``--tokenizer``), else from the
  ``root`` the first instance reports in ``/v1/models`` when that path exists here.
  Without a local tokenizer the instance's own ``/tokenize`` endpoint is asked (one
  extra round trip, deadline ``timeout``).

Anything else (a batch of prompts, a tokenizer error, an instance that does not
answer ``/tokenize``) gives no token ids: the router then routes by load alone, never
fails the request for it. A body that is not a request at all (no ``prompt`` or
``messages``) is a 400 from the engine, as without the router.
"""

from __future__ import annotations

import asyncio
import logging
import os

import aiohttp

logger = logging.getLogger("mctier.router")


class Prompts:
    def __init__(self, tokenizer: str | None = None, timeout: float = 2.0):
        self.path, self.timeout = tokenizer, timeout
        self._renderer = None
        self._tried = False
        self._done = False
        self._lock = asyncio.Lock()

    @property
    def state(self) -> str:
        """``loading`` until the tokenizer is settled (the router starts loading it; a string
        prompt waits for it meanwhile), then ``local`` (this process tokenizes) or
        ``instances`` (a string prompt asks an instance's ``/tokenize``)."""
        if not self._done:
            return "loading"
        return "local" if self._renderer is not None else "instances"

    async def load(self, session: aiohttp.ClientSession, pool):
        """The local tokenizer (loaded at most once), or None."""
        return await self._local(session, pool)

    async def _local(self, session: aiohttp.ClientSession, pool):
        async with self._lock:
            if self._tried:
                return self._renderer
            self._tried = True
            try:
                path = self.path or await self._root(session, pool)
                if path and (self.path or os.path.isdir(path)):
                    from mcstore.tools.engine import Renderer

                    try:
                        self._renderer = await asyncio.to_thread(Renderer, path)
                        logger.info("tokenizer: %s", path)
                    except Exception as e:  # noqa: BLE001 - ConfigError and whatever transformers raises
                        logger.warning("no local tokenizer (%s); asking the instances' /tokenize", e)
                else:
                    logger.info("no local tokenizer: asking the instances' /tokenize")
            finally:
                self._done = True  # also when cancelled: never "loading" for ever
            return self._renderer

    async def _root(self, session: aiohttp.ClientSession, pool) -> str | None:
        for inst in pool.all:
            try:
                async with session.get(inst.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=self.timeout)) as r:
                    card = (await r.json())["data"][0]
                    return card.get("root") or card.get("id")
            except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, IndexError, ValueError):
                continue
        return None

    async def token_ids(self, session: aiohttp.ClientSession, pool, path: str, body: dict) -> list[int]:
        prompt, messages = body.get("prompt"), body.get("messages")
        if path.endswith("/completions") and not path.endswith("chat/completions"):
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                return prompt
            if not isinstance(prompt, str):
                return []
        elif not isinstance(messages, list):
            return []
        renderer = await self._local(session, pool)
        if renderer is not None:
            try:
                if isinstance(prompt, str) and not path.endswith("chat/completions"):
                    return await asyncio.to_thread(renderer.text, prompt)
                return await asyncio.to_thread(renderer.messages, messages, True)
            except Exception as e:  # noqa: BLE001 - a prompt the tokenizer cannot take: route by load
                logger.debug("tokenizer failed: %s", e)
                return []
        return await self._remote(session, pool, {"prompt": prompt} if isinstance(prompt, str) else
                                  {"messages": messages, "add_generation_prompt": True}, body.get("model"))

    async def _remote(self, session, pool, req: dict, model) -> list[int]:
        up = [i for i in pool.all if i.healthy]
        if not up:
            return []
        if model:
            req["model"] = model
        try:
            async with session.post(up[0].url + "/tokenize", json=req,
                                    timeout=aiohttp.ClientTimeout(total=self.timeout)) as r:
                if r.status == 200:
                    return list((await r.json()).get("tokens") or [])
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            pass
        return []
