"""The router's reads of a peer's answers (``/metrics``, ``/v1/models``, ``/tokenize``) against
a real aiohttp server on loopback: read to their end, bounded in size, checked in shape; a bad
answer counts as none."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from multi.router import instances, intake
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


def _chunked(body: bytes, content_type: str = "application/json", pause_s: float = 0.0):
    """A handler streaming ``body`` in 4 KB chunks, ``pause_s`` apart."""
    async def handler(request):
        resp = web.StreamResponse(headers={"Content-Type": content_type})
        await resp.prepare(request)
        for i in range(0, len(body), 4096):
            await resp.write(body[i:i + 4096])
            if pause_s:
                await asyncio.sleep(pause_s)
        await resp.write_eof()
        return resp
    return handler


def test_health_read_takes_a_metrics_body_that_arrives_in_many_chunks(monkeypatch):
    """A ~200 KB /metrics streamed in small chunks with the cache size last: the health read
    gets all of it (one ``read(n)`` returns only what has arrived); a body over
    MAX_METRICS_BYTES is not parsed, the old values stay."""
    filler = "".join(f'vllm:other_metric{{i="{i}"}} {i}.0\n' for i in range(6000))
    tail = ('vllm:num_requests_running{engine="0"} 2.0\n'
            'vllm:cache_config_info{block_size="32",num_gpu_blocks="777"} 1.0\n')
    body = (filler + tail).encode()
    assert len(body) > 150_000

    async def health(request):
        return web.Response(text="ok")

    async def check(url):
        inst = make("plain", url)
        async with aiohttp.ClientSession() as session:
            ok = await instances.check_health(session, inst, 10.0)
        return ok, inst.cache_blocks, inst.running

    h = {("GET", "/metrics"): _chunked(body, "text/plain", 0.001), ("GET", "/health"): health}
    assert asyncio.run(_serve(h, check)) == (True, 777, 2.0)
    monkeypatch.setattr(instances, "MAX_METRICS_BYTES", len(body) - 1)
    ok, blocks, running = asyncio.run(_serve(h, check))
    assert ok and blocks != 777 and running != 2.0


def test_model_cards_reads_a_chunked_answer_whole_and_drops_one_over_the_cap(monkeypatch):
    cards = {"data": [{"id": "m", "root": "/x", "max_model_len": 4096, "pad": "p" * 100_000}]}
    body = json.dumps(cards).encode()

    async def ask(url):
        async with aiohttp.ClientSession() as s:
            return await intake.model_cards(s, url, 10.0)

    h = {("GET", "/v1/models"): _chunked(body)}
    assert asyncio.run(_serve(h, ask))[0]["max_model_len"] == 4096
    monkeypatch.setattr(intake, "MAX_PEER_JSON_BYTES", len(body) - 1)
    assert asyncio.run(_serve(h, ask)) == []


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


def test_a_tokenize_answer_over_the_cap_or_not_json_gives_no_ids(monkeypatch):
    big = json.dumps({"tokens": list(range(50_000))}).encode()

    async def ask(url):
        prompts = Prompts(tokenizer=None, timeout=10.0)
        async with aiohttp.ClientSession() as s:
            return await prompts._remote(s, _Pool(url), {"prompt": "hi"}, None)

    h = {("POST", "/tokenize"): _chunked(big)}
    assert asyncio.run(_serve(h, ask)) == list(range(50_000))
    monkeypatch.setattr(intake, "MAX_PEER_JSON_BYTES", len(big) - 1)
    assert asyncio.run(_serve(h, ask)) == []
    assert asyncio.run(_serve({("POST", "/tokenize"): _chunked(b'{"tokens": [1,')}, ask)) == []


def test_token_ids_takes_only_a_list_of_64_bit_non_negative_ints():
    assert token_ids([0, (1 << 63) - 1]) == [0, (1 << 63) - 1]
    assert token_ids(None) == [] and token_ids("12") == [] and token_ids([1.0]) == []


class _Pool:
    def __init__(self, url: str):
        self.all = [make("plain", url)]
