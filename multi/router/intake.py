"""What the router takes from a client before it routes anything, and how long that may take.

- :func:`read_json`: a completion request is JSON (``Content-Type: application/json`` or
  ``...+json``; else 415: a browser's cross-site ``text/plain`` POST to a loopback router is
  refused before it is read), at most ``--max-body-mb`` (else 413), one JSON object (else
  400). A body above :data:`PARSE_INLINE` bytes is parsed in a thread, off the event loop that
  serves every other request.
- :func:`check_prompt`: at most the served model's ``max_model_len`` tokens (else 400, as the
  engine would answer, but before the router hashes them).
- :func:`block_hashes`: the prompt's block hashes (:func:`multi.router.index.chain`), in a
  thread for more than :data:`HASH_INLINE_TOKENS` tokens.
- :func:`peer_json`: a peer's JSON answer, at most :data:`MAX_PEER_JSON_BYTES` (a longer one
  is not read and counts as no answer);
- :func:`model_cards`: an instance's ``/v1/models`` cards, checked (a peer's answer);
- :func:`max_model_len`: the served model's, from the first instance whose ``/v1/models``
  answers (vLLM's model card carries it).
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from multi.router.index import chain
from multi.router.instances import read_at_most
from p2p.proxy import ProxyError

PARSE_INLINE = 64 << 10
HASH_INLINE_TOKENS = 8192
# A peer's /v1/models or /tokenize answer: a 1M-token prompt's ids are ~10 MB of JSON.
MAX_PEER_JSON_BYTES = 16 << 20


async def loads(raw: bytes):
    """``json.loads(raw)``, in a thread above :data:`PARSE_INLINE` bytes (off the event loop
    that serves every other request)."""
    return json.loads(raw) if len(raw) <= PARSE_INLINE else await asyncio.to_thread(json.loads, raw)


def is_json(content_type: str) -> bool:
    return content_type == "application/json" or (content_type.startswith("application/")
                                                   and content_type.endswith("+json"))


async def read_json(request: web.Request) -> dict:
    """The request's JSON object, or ``ProxyError`` (415, 413, 400) naming what is wrong."""
    if not is_json(request.content_type):
        raise ProxyError(415, f"a request body must be JSON (Content-Type: application/json), got "
                              f"{request.content_type[:100]!r}")
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as e:
        raise ProxyError(413, f"request body larger than the router's limit ({e.text})") from None
    try:
        body = await loads(raw)
    except (ValueError, RecursionError) as e:
        raise ProxyError(400, f"invalid JSON body: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise ProxyError(400, "invalid JSON body: body must be a JSON object")
    return body


def check_prompt(tokens: list[int], limit: int | None) -> None:
    if limit is not None and len(tokens) > limit:
        raise ProxyError(400, f"the prompt has {len(tokens)} tokens, more than the model's maximum context "
                              f"length of {limit} tokens")


async def block_hashes(tokens: list[int], block_size: int, salt) -> list[int]:
    """``ProxyError(400)`` for token ids a 64-bit integer cannot hold (the engine would refuse
    them too) or a salt that is not a string."""
    if not tokens:
        return []
    if salt is not None and not isinstance(salt, str):
        raise ProxyError(400, "cache_salt must be a string")
    try:
        if len(tokens) <= HASH_INLINE_TOKENS:
            return chain(tokens, block_size, salt)
        return await asyncio.to_thread(chain, tokens, block_size, salt)
    except (OverflowError, TypeError):
        raise ProxyError(400, "prompt token ids must be integers that fit in 64 bits") from None


async def peer_json(r: aiohttp.ClientResponse, limit: int | None = None):
    """The JSON value of a peer's answer ``r``; ``ValueError`` when it is longer than
    ``limit`` bytes (default :data:`MAX_PEER_JSON_BYTES`) or not JSON (parsed by :func:`loads`,
    as a client's body is)."""
    limit = MAX_PEER_JSON_BYTES if limit is None else limit
    raw = await read_at_most(r.content, limit)
    if raw is None:
        raise ValueError(f"answer longer than {limit} bytes")
    try:
        return await loads(raw)
    except RecursionError:
        raise ValueError("answer nested too deeply") from None


async def model_cards(session: aiohttp.ClientSession, url: str, timeout: float) -> list[dict]:
    """The model cards of the instance's ``/v1/models`` (vLLM's: ``id``, ``root``, ``parent``,
    ``max_model_len``); ``[]`` when it does not answer with a list of them within ``timeout``."""
    try:
        async with session.get(url + "/v1/models", timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            body = await peer_json(r) if r.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return []
    data = body.get("data") if isinstance(body, dict) else None
    return [c for c in data if isinstance(c, dict)] if isinstance(data, list) else []


async def max_model_len(session: aiohttp.ClientSession, pool, timeout: float) -> int | None:
    for inst in pool.all:
        cards = await model_cards(session, inst.url, timeout)
        n = cards[0].get("max_model_len") if cards else None
        if isinstance(n, int) and n > 0:
            return n
    return None
