"""The router's reads of a peer's JSON answers (``/v1/models``, ``/tokenize``) against a real
aiohttp server on loopback: bounded in size, checked in shape; a bad answer counts as none."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from multi.router import intake
from multi.router.instances import make
from multi.router.prompts import Prompts, token_ids

pytestmark = pytest.mark.unit


async def _serve(handlers: dict, fn):
    """Runs ``fn(url)`` against a loopback server whose routes are ``handlers``."""
    app = web.Application()
    for (method, path), h in handlers.items():
        app.router.add_route(method, path, h)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        return await fn(f"http://127.0.0.1:{port}")
    finally:
        await runner.cleanup()


def _chunked(body: bytes):
    async def handler(request):
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        for i in range(0, len(body), 4096):
            await resp.write(body[i:i + 4096])
        await resp.write_eof()
        return resp
    return handler


def test_model_cards_reads_a_chunked_answer_whole_and_drops_one_over_the_cap():
    cards = {"data": [{"id": "m", "root": "/x", "max_model_len": 4096, "pad": "p" * 100_000}]}
    body = json.dumps(cards).encode()

    async def ask(url):
        async with aiohttp.ClientSession() as s:
            return await intake.model_cards(s, url, 10.0)

    h = {("GET", "/v1/models"): _chunked(body)}
    assert asyncio.run(_serve(h, ask))[0]["max_model_len"] == 4096
    limit0 = intake.MAX_PEER_JSON_BYTES
    try:
        intake.MAX_PEER_JSON_BYTES = len(body) - 1
        assert asyncio.run(_serve(h, ask)) == []
    finally:
        intake.MAX_PEER_JSON_BYTES = limit0


@pytest.mark.parametrize("answer, ids", [
    ({"tokens": [1, 2, 3]}, [1, 2, 3]),
    ({"tokens": [1, "2", 3]}, []),
    ({"tokens": [1, True]}, []),
    ({"tokens": [1, -1]}, []),
    ({"tokens": [1, 1 << 63]}, []),
    ({"tokens": {"a": 1}}, []),
    ([1, 2], []),
    ({"count": 3}, []),
])
def test_a_tokenize_answer_gives_ids_only_when_they_are_token_ids(answer, ids):
    async def tokenize(request):
        return web.json_response(answer)

    async def ask(url):
        prompts = Prompts(tokenizer=None, timeout=10.0)
        async with aiohttp.ClientSession() as s:
            return await prompts._remote(s, _Pool(url), {"prompt": "hi"}, None)

    assert asyncio.run(_serve({("POST", "/tokenize"): tokenize}, ask)) == ids


def test_a_tokenize_answer_over_the_cap_or_not_json_gives_no_ids():
    big = json.dumps({"tokens": list(range(50_000))}).encode()

    async def ask(url):
        prompts = Prompts(tokenizer=None, timeout=10.0)
        async with aiohttp.ClientSession() as s:
            return await prompts._remote(s, _Pool(url), {"prompt": "hi"}, None)

    h = {("POST", "/tokenize"): _chunked(big)}
    assert asyncio.run(_serve(h, ask)) == list(range(50_000))
    limit0 = intake.MAX_PEER_JSON_BYTES
    try:
        intake.MAX_PEER_JSON_BYTES = len(big) - 1
        assert asyncio.run(_serve(h, ask)) == []
    finally:
        intake.MAX_PEER_JSON_BYTES = limit0
    assert asyncio.run(_serve({("POST", "/tokenize"): _chunked(b'{"tokens": [1,')}, ask)) == []


def test_token_ids_takes_only_a_list_of_64_bit_non_negative_ints():
    assert token_ids([0, (1 << 63) - 1]) == [0, (1 << 63) - 1]
    assert token_ids(None) == [] and token_ids("12") == [] and token_ids([1.0]) == []


class _Pool:
    def __init__(self, url: str):
        self.all = [make("plain", url)]
