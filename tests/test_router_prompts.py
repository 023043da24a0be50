"""When the router sends a string completion prompt on as its own token ids
(:meth:`multi.router.prompts.Prompts.as_ids`), without engines: only where every healthy
instance agreed and the request needs nothing of the text. The check against a real
engine's ``/tokenize`` (and a tokenizer that disagrees) is in ``tests/test_router_e2e.py``."""

from __future__ import annotations

import pytest

from multi.router.instances import Pool, make
from multi.router.prompts import NEEDS_TEXT, Prompts

pytestmark = pytest.mark.unit

PATH = "/v1/completions"
IDS = [5, 6, 7]


def agreed(*urls: str, names=frozenset({"m"})) -> Prompts:
    p = Prompts()
    p.agreed = {u: names for u in urls}
    return p


def test_a_string_prompt_goes_out_as_ids_where_every_healthy_instance_agreed():
    pool = Pool([make("plain", "http://127.0.0.1:8100"), make("plain", "http://127.0.0.1:8101")])
    body = {"model": "m", "prompt": "hello there", "max_tokens": 4}
    both = agreed("http://127.0.0.1:8100", "http://127.0.0.1:8101")
    assert both.as_ids(PATH, body, IDS, pool) == {**body, "prompt": IDS}
    assert both.as_ids(PATH, {"prompt": "hello"}, IDS, pool)["prompt"] == IDS  # no model: the default one
    assert body["prompt"] == "hello there"  # the client's body is not changed
    one = agreed("http://127.0.0.1:8100")
    assert one.as_ids(PATH, body, IDS, pool) is body  # 8101 not checked (or disagreed)
    pool.all[1].healthy = False  # out of rotation: no route or retry takes it
    assert one.as_ids(PATH, body, IDS, pool)["prompt"] == IDS
    pool.all[0].healthy = False
    assert one.as_ids(PATH, body, IDS, pool) is body  # nobody healthy


def test_requests_that_need_the_text_or_another_model_keep_it():
    pool = Pool([make("plain", "http://127.0.0.1:8100")])
    p = agreed("http://127.0.0.1:8100")
    body = {"model": "m", "prompt": "hello"}
    for field in NEEDS_TEXT:
        assert p.as_ids(PATH, {**body, field: True}, IDS, pool)["prompt"] == "hello", field
    assert p.as_ids(PATH, {**body, "echo": False}, IDS, pool)["prompt"] == IDS
    assert p.as_ids(PATH, {**body, "model": "a-lora"}, IDS, pool)["prompt"] == "hello"
    assert p.as_ids(PATH, {**body, "model": ["m"]}, IDS, pool)["prompt"] == "hello"  # the engine's 400, not ours
    assert p.as_ids(PATH, {**body, "add_special_tokens": "no"}, IDS, pool)["prompt"] == "hello"
    assert p.as_ids(PATH, {**body, "add_special_tokens": False}, IDS, pool)["prompt"] == IDS
    assert p.as_ids("/v1/chat/completions", body, IDS, pool)["prompt"] == "hello"
    assert p.as_ids(PATH, body, [], pool)["prompt"] == "hello"  # no local tokenization
    assert p.as_ids(PATH, {"model": "m", "prompt": IDS}, IDS, pool)["prompt"] == IDS  # ids already


def test_nothing_is_forwarded_before_a_check():
    pool = Pool([make("plain", "http://127.0.0.1:8100")])
    assert Prompts().as_ids(PATH, {"prompt": "hello"}, IDS, pool) == {"prompt": "hello"}
    assert not Prompts().forwarding(pool)


def test_short_prompts_are_tokenized_on_the_loop_long_ones_in_a_thread_with_the_same_ids(tiny_model, monkeypatch):
    """A string prompt up to TOKENIZE_INLINE_CHARS is tokenized without a thread round trip,
    a longer one in a thread; both give the tokenizer's own ids, special tokens as asked."""
    import asyncio

    from mcstore.tools.engine import Renderer
    from multi.router import prompts as mod

    ref = Renderer(tiny_model)
    threads: list[int] = []
    real = asyncio.to_thread

    async def counted(fn, *a, **kw):
        threads.append(len(a[0]) if a and isinstance(a[0], str) else -1)
        return await real(fn, *a, **kw)
    monkeypatch.setattr(mod.asyncio, "to_thread", counted)
    short = "The quick brown fox, " * 20
    long = "jumps over the lazy dog 12345; " * (mod.TOKENIZE_INLINE_CHARS // 20)
    assert len(short) <= mod.TOKENIZE_INLINE_CHARS < len(long)
    p = Prompts(tiny_model)

    async def ids(prompt: str, **kw) -> list[int]:
        return await p.token_ids(None, Pool([]), PATH, {"prompt": prompt, **kw})
    got = asyncio.run(ids(short))
    assert got == ref.text(short) and threads == [-1]  # the tokenizer's load only
    assert asyncio.run(ids(short, add_special_tokens=False)) == ref.text(short, False) and threads == [-1]
    assert asyncio.run(ids(long)) == ref.text(long) and threads == [-1, len(long)]
