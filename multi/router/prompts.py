"""Prompt token ids for the router's index, as the engines will see them.

- ``/v1/completions`` with ``prompt`` a list of token ids: those ids;
- ``prompt`` a string: the served model's tokenizer (special tokens added, as vLLM's
  OpenAI server does); ``/v1/chat/completions``: its chat template with the generation
  prompt;
- the tokenizer is loaded once from ``tokenizer`` (``--tokenizer``), else from the
  ``root`` the first instance reports in ``/v1/models`` when that path exists here.
  Without a local tokenizer the instance's own ``/tokenize`` endpoint is asked (one
  extra round trip, deadline ``timeout``; its answer is a peer's: at most
  :data:`multi.router.intake.MAX_PEER_JSON_BYTES`, ids checked by :func:`token_ids`).

Anything else (a batch of prompts, a tokenizer error, an instance that does not
answer ``/tokenize``) gives no token ids: the router then routes by load alone, never
fails the request for it. A body that is not a request at all (no ``prompt`` or
``messages``) is a 400 from the engine, as without the router.

Tokenized once: a ``/v1/completions`` string prompt the local tokenizer turned into ids is
sent on as those ids (:meth:`Prompts.as_ids`), so the engine does not tokenize it a second
time on the request's path (docs/benchmarks/router.md, "the hop"). Only where that cannot
change an answer: every instance in the pool gave, from its own ``/tokenize``, the same ids
as the local tokenizer for :data:`PROBES` (with and without special tokens; checked by
:meth:`Prompts.verify` when an instance joins, forgotten when it leaves the rotation), the
request names one of those instances' base models (or none), and it asks for nothing that
needs the prompt's text (``echo``, ``return_token_offsets``, ``prompt_embeds``).
"""

from __future__ import annotations

import asyncio
import logging
import os

import aiohttp

from multi.router.intake import model_cards, peer_json

logger = logging.getLogger("mctier.router")

# Texts on which a tokenizer that is not the engine's would most likely differ: plain words,
# whitespace runs, non-ASCII, and the special tokens written out as text (added at load).
PROBES = ("The quick brown fox jumps over the lazy dog, 1234567890 times.",
          "  leading,\ttabs\n\nand trailing spaces   ",
          "Ünïcödé — 漢字 かな 🙂 ∑ ≠ ﬁ")
# A string prompt up to this many characters (~2K tokens of English; at most ~4 ms on an idle core
# for digit-heavy text, 1.4 ms measured for 2,318 tokens in 3.2K characters) is tokenized on
# the event loop: the thread round trip cost more than the work on two busy cores (tokenize
# phase 5.2 ms a request for 1.4 ms of work, docs/benchmarks/router.md, "the hop"). Longer
# prompts and chat templates go to a thread, off the loop that relays every other answer.
TOKENIZE_INLINE_CHARS = 8192
# Body fields with which an id prompt would answer differently from the text it came from.
NEEDS_TEXT = ("echo", "return_token_offsets", "prompt_embeds")


class Prompts:
    def __init__(self, tokenizer: str | None = None, timeout: float = 2.0, forward_ids: bool = True):
        self.path, self.timeout, self.forward_ids = tokenizer, timeout, forward_ids
        self._renderer = None
        self._tried = False
        self._done = False
        self._lock = asyncio.Lock()
        # Instance URL -> the base model names whose tokenization matched the local tokenizer's.
        self.agreed: dict[str, frozenset[str]] = {}
        self._checked: set[str] = set()  # verified (matched or not) since they joined

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
            cards = await model_cards(session, inst.url, self.timeout)
            if cards:
                return cards[0].get("root") or cards[0].get("id")
        return None

    async def verify(self, session: aiohttp.ClientSession, pool) -> None:
        """Check each healthy instance not yet checked since it joined: its ``/tokenize`` of
        :data:`PROBES` against the local tokenizer's (:meth:`as_ids` forwards ids only where
        all agree). An instance out of rotation is checked again when it returns."""
        for inst in pool.all:
            if not inst.healthy:
                self._checked.discard(inst.url)
                self.agreed.pop(inst.url, None)
        renderer = self._renderer if self._done else None
        if renderer is None or not self.forward_ids:
            return
        for inst in [i for i in pool.all if i.healthy and i.url not in self._checked]:
            self._checked.add(inst.url)
            names = await self._agrees(session, inst, renderer)
            if names:
                self.agreed[inst.url] = names
                logger.info("%s tokenizes as this router does (%s): string prompts are sent as token ids",
                            inst.url, ", ".join(sorted(names)))
            else:
                logger.warning("%s does not tokenize as this router's tokenizer (or did not answer): "
                               "string prompts are sent to the pool as text", inst.url)

    async def _agrees(self, session, inst, renderer) -> frozenset[str]:
        cards = await model_cards(session, inst.url, self.timeout)
        names = frozenset(c["id"] for c in cards if isinstance(c.get("id"), str) and not c.get("parent"))
        if not names:
            return frozenset()
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        try:
            specials = " ".join(str(t) for t in getattr(renderer.tok, "all_special_tokens", []))
            for text in (*PROBES, f"{specials} between {specials}"):
                for special in (True, False):
                    req = {"prompt": text, "add_special_tokens": special, "model": next(iter(names))}
                    async with session.post(inst.url + "/tokenize", json=req, timeout=timeout) as r:
                        answer = await peer_json(r) if r.status == 200 else None
                    theirs = answer.get("tokens") if isinstance(answer, dict) else None  # a peer's answer
                    if theirs != await asyncio.to_thread(renderer.text, text, special):
                        return frozenset()
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            logger.debug("tokenizer check of %s failed: %r", inst.url, e)
            return frozenset()
        return names

    def as_ids(self, path: str, body: dict, tokens: list[int], pool) -> dict:
        """``body`` with its string ``prompt`` replaced by ``tokens`` (its local tokenization)
        where that gives the same answer (module docstring), else ``body`` itself."""
        if (not tokens or not isinstance(body.get("prompt"), str) or path.endswith("chat/completions")
                or any(body.get(k) for k in NEEDS_TEXT) or not isinstance(body.get("add_special_tokens", True), bool)
                or not isinstance(body.get("model", ""), str)):
            return body
        return {**body, "prompt": tokens} if self.forwarding(pool, body.get("model")) else body

    def forwarding(self, pool, model: str | None = None) -> bool:
        """Whether string prompts for ``model`` (None: the default) go out as ids: every
        instance a route or its retry may take, the healthy ones, agreed (one that rejoins is
        healthy before :meth:`verify` has checked it, and until then not in ``agreed``)."""
        up = [i for i in pool.all if i.healthy]
        return bool(up) and all((names := self.agreed.get(i.url)) and (model is None or model in names) for i in up)

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
                    special = body.get("add_special_tokens", True)  # vLLM's completion field
                    special = special if isinstance(special, bool) else True
                    if len(prompt) <= TOKENIZE_INLINE_CHARS:
                        return renderer.text(prompt, special)
                    return await asyncio.to_thread(renderer.text, prompt, special)
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
                answer = await peer_json(r) if r.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return []
        return token_ids(answer.get("tokens") if isinstance(answer, dict) else None)


def token_ids(value) -> list[int]:
    """``value`` when it is a list of token ids (integers in [0, 2**63)), else ``[]`` (a peer's
    ``/tokenize`` answer; a prompt without ids is routed by load)."""
    if not isinstance(value, list):
        return []
    ok = all(type(t) is int and 0 <= t < 1 << 63 for t in value)
    return value if ok else []
