"""The router's block index (``multi.router.index``) and the KV event subscriber
(``multi.router.events``, ``multi.router.eventwire``) against vLLM's real ``ZmqEventPublisher`` and real event structs.

No engine is started: the publisher is vLLM's own class, constructed standalone on
``ipc://`` sockets in a temporary directory (a form vLLM binds, with no network listener;
the subscriber connects). ``test_subscriber_binds_where_the_engine_connects`` covers the
other form, ``tcp://HOST:P``, which the engine connects to and the subscriber binds.
Engine block hashes are made up (sha256 of parent and tokens,
as bytes like vLLM's default, or ints like ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``).
Gaps are real: the subscriber is stopped while the publisher sends, then started again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import msgspec
import pytest
import zmq
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)

from kvcore.procs import free_port
from multi.router import eventwire
from multi.router.events import EventSubscriber
from multi.router.eventwire import decode_batch, subscriber_address
from multi.router.index import BlockIndex, chain

pytestmark = pytest.mark.unit

BS = 4
INST = "http://127.0.0.1:8100"
JOIN_S = 0.3  # lets a SUB's subscription reach the PUB before anything is published


def wait_for(cond, timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def engine_hashes(tokens, as_int: bool = False) -> list:
    """Stand-ins for vLLM's block hashes: a chain, but not the router's."""
    out, parent = [], b"engine-seed"
    for i in range(0, len(tokens) - BS + 1, BS):
        parent = hashlib.sha256(parent + json.dumps(tokens[i:i + BS]).encode()).digest()
        out.append(int.from_bytes(parent[:8], "big") if as_int else parent)
    return out


def stored(hashes, parent, tokens, *, medium="GPU", group_idx=0, kind="full_attention",
           lora=None, extra_keys=None, block_size=BS) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                       block_size=block_size, lora_id=1 if lora else None, medium=medium,
                       lora_name=lora, extra_keys=extra_keys, group_idx=group_idx,
                       kv_cache_spec_kind=kind, session_id="sess-1")


def publish(pub: ZmqEventPublisher, *events) -> None:
    pub.publish(KVEventBatch(ts=time.time(), events=list(events)))


@pytest.fixture
def make_pub():
    made = []
    d = tempfile.mkdtemp(prefix="mct-ev-")  # short: a unix socket path has ~107 bytes

    def make(replay: bool = True, buffer_steps: int = 10_000, ports=None):
        n = len(made)
        pub_ep, rep_ep = ports or (f"ipc://{d}/pub{n}", f"ipc://{d}/rep{n}")
        deadline = time.monotonic() + 5
        while True:
            try:
                pub = ZmqEventPublisher(data_parallel_rank=0, endpoint=pub_ep,
                                        replay_endpoint=rep_ep if replay else None, buffer_steps=buffer_steps)
                break
            except zmq.ZMQError:  # a restart on the same sockets: the old one is still closing
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        made.append(pub)
        return pub, pub_ep, rep_ep, (pub_ep, rep_ep)

    yield make
    for pub in made:
        if pub._running:
            pub.shutdown()
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def make_sub():
    made = []

    def make(*args, **kw) -> EventSubscriber:
        sub = EventSubscriber(*args, **kw)
        made.append(sub)
        sub.start()
        time.sleep(JOIN_S)
        return sub

    yield make
    for sub in made:
        sub.stop()


# -- the index --------------------------------------------------------------------------
def test_chain_deterministic_prefix_and_salted():
    toks = [7, 3, 9, 1, 4, 4, 2, 8, 5, 0, 6]  # 2 full blocks of 4 + 3 tokens
    h = chain(toks, BS)
    assert len(h) == 2 and h == chain(list(toks), BS)
    assert chain(toks[:8], BS) == h and chain(toks[:7], BS) == h[:1]  # prefix property
    assert chain(toks + [1], BS) == h + chain(toks + [1], BS)[2:]
    changed = chain(toks[:4] + [99] + toks[5:], BS)
    assert changed[0] == h[0] and changed[1] != h[1]  # a change moves only what follows
    salted = chain(toks, BS, salt="tenant-a")
    assert salted[0] != h[0] and salted[1] != h[1] and chain(toks, BS, salt="") == h
    assert chain(toks[4:8], BS, parent=h[0]) == h[1:]
    assert all(0 <= x < 2**64 for x in h + salted)
    # another process, another str hash seed, and the module imports no vLLM
    code = ("import json, sys; from multi.router.events import EventSubscriber; "
            "from multi.router.index import chain; "
            f"print(json.dumps([chain({toks}, {BS}), chain({toks}, {BS}, 'tenant-a'), "
            "'vllm' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONHASHSEED": "12345"}, timeout=30,
                         cwd=os.path.dirname(os.path.dirname(__file__)), check=True)
    assert json.loads(out.stdout) == [h, salted, False]


def test_lru_bound_evicts_oldest():
    idx = BlockIndex(BS, default_capacity=3)
    idx.record("a", [1, 2, 3, 4, 5])
    assert idx.blocks("a") == 3 and [idx.has("a", h) for h in (1, 2, 3, 4, 5)] == [
        False, False, True, True, True]
    assert idx.match("a", [3]) == 1  # touches 3: now 4 is the oldest
    idx.record("a", [6])
    assert [idx.has("a", h) for h in (3, 4, 5, 6)] == [True, False, True, True]
    idx.set_capacity("a", 1)
    assert idx.blocks("a") == 1 and idx.has("a", 6)
    idx.set_capacity("b", 2)
    idx.stored("b", [10, 11, 12])
    assert idx.capacity("b") == 2 and idx.blocks("b") == 2 and idx.total_blocks() == 3
    idx.drop("a")
    assert idx.instances() == ["b"] and idx.capacity("a") == 3


def test_match_counts_leading_blocks_only():
    idx = BlockIndex(BS)
    a, b, c = chain(list(range(12)), BS)
    idx.stored("store", [a, b, c])
    assert idx.match("store", [a, b, c]) == 3
    assert idx.match("store", [a, b, 999, c]) == 2
    assert idx.match("store", [999, a, b]) == 0
    assert idx.match("elsewhere", [a]) == 0 and "elsewhere" not in idx.instances()
    idx.removed("store", [b])
    assert idx.match("store", [a, b, c]) == 1
    idx.cleared("store")
    assert idx.blocks("store") == 0 and idx.match("store", [a]) == 0


# -- the wire format --------------------------------------------------------------------
def test_decoder_reads_vllm_encoding_and_other_layouts():
    ev = stored([b"\x01" * 32, 7], None, list(range(8)), extra_keys=[("salt",), None])
    batch = KVEventBatch(ts=123.5, events=[ev, BlockRemoved(block_hashes=[7], medium="GPU",
                                                             group_idx=0), AllBlocksCleared()],
                         data_parallel_rank=0)
    payload = msgspec.msgpack.Encoder().encode(batch)  # what ZmqEventPublisher sends
    ts, (s, r, c) = decode_batch(payload)
    assert ts == 123.5
    assert (s.block_hashes, s.parent_block_hash, s.token_ids, s.block_size, s.medium,
            s.extra_keys, s.group_idx, s.kv_cache_spec_kind, s.session_id) == (
        [b"\x01" * 32, 7], None, list(range(8)), BS, "GPU", [["salt"], None], 0,
        "full_attention", "sess-1")
    assert isinstance(r, eventwire.BlockRemoved) and r.block_hashes == [7] and r.group_idx == 0
    assert isinstance(c, eventwire.AllBlocksCleared)
    # legacy vLLM (array_like events, fewer fields), a future one (extra fields, new kind)
    legacy = msgspec.msgpack.encode([1.0, [
        ["BlockStored", [5], None, [1, 2, 3, 4], BS, None],
        ["BlockStored", [6], 5, [1, 2, 3, 4], BS, None, "GPU", None, None, 0, "x", None,
         None, None, None, "a-future-field"],
        ["BlockRemoved", [5]], ["AllBlocksCleared"], ["BlockMoved", [5]]]])
    future = msgspec.msgpack.encode([2.0, [{"type": "BlockRemoved", "block_hashes": [9],
                                            "medium": "GPU", "new_field": [1, 2]}], 0, "x"])
    _, ev = decode_batch(legacy)
    assert [type(e).__name__ for e in ev] == [
        "_BlockStoredArray", "_BlockStoredArray", "_BlockRemovedArray",
        "_AllBlocksClearedArray", "NoneType"]
    assert isinstance(ev[0], eventwire.BlockStored) and ev[0].medium is None
    assert ev[1].parent_block_hash == 5 and ev[1].group_idx == 0 and ev[2].block_hashes == [5]
    _, (r,) = decode_batch(future)
    assert r.block_hashes == [9] and r.medium == "GPU"


# -- subscriber against the real publisher ----------------------------------------------
def test_stored_removed_cleared_via_real_publisher(make_pub, make_sub):
    pub, ep, rep, _ = make_pub()
    idx = BlockIndex(BS)
    sub = make_sub(INST, ep, idx, rep)
    toks = list(range(100, 100 + 3 * BS + 2))  # 3 full blocks and a partial one
    e = engine_hashes(toks)
    want = chain(toks, BS)
    publish(pub, stored(e[:2], None, toks[:2 * BS]))  # one event may carry several blocks
    publish(pub, stored(e[2:], e[1], toks[2 * BS:3 * BS]),
            stored(e[:1], None, toks[:BS], group_idx=1, kind="sliding_window"))
    assert wait_for(lambda: idx.match(INST, want) == 3), sub.stats()
    assert idx.blocks(INST) == 3
    publish(pub, BlockRemoved(block_hashes=[e[0]], medium="CPU", group_idx=0))  # other tier
    publish(pub, BlockRemoved(block_hashes=[e[1]], medium="GPU", group_idx=1))  # other group
    publish(pub, BlockRemoved(block_hashes=[e[1]], medium="GPU", group_idx=0))
    assert wait_for(lambda: sub.stats()["last_seq"] == 4)
    assert idx.match(INST, want) == 1 and idx.blocks(INST) == 2
    publish(pub, AllBlocksCleared())
    assert wait_for(lambda: sub.stats()["last_seq"] == 5)
    assert idx.blocks(INST) == 0
    st = sub.stats()
    assert (st["batches"], st["events"], st["ignored_medium"], st["ignored_group"],
            st["gaps"], st["stale"], st["group"]) == (6, 7, 1, 2, 0, False, 0)
    assert 0 <= st["lag_s"] < 2.0


def test_salt_int_hashes_and_lora(make_pub, make_sub):
    pub, ep, rep, _ = make_pub()
    idx = BlockIndex(BS)
    sub = make_sub(INST, ep, idx, rep)
    toks = list(range(40, 40 + 2 * BS))
    e = engine_hashes(toks, as_int=True)
    publish(pub, stored(e, None, toks, extra_keys=[("tenant-a",), None]))
    lt = list(range(900, 900 + 2 * BS))
    le = engine_hashes(lt)
    publish(pub, stored(le[:1], None, lt[:BS], lora="adapter",
                        extra_keys=[("adapter",)]),
            stored(le[1:], le[0], lt[BS:]))  # a LoRA block's child: no LoRA field, yet tainted
    assert wait_for(lambda: sub.stats()["last_seq"] == 1)
    assert idx.match(INST, chain(toks, BS, salt="tenant-a")) == 2
    assert idx.match(INST, chain(toks, BS)) == 0
    assert idx.blocks(INST) == 2 and sub.stats()["unrepresentable"] == 2
    publish(pub, BlockRemoved(block_hashes=[e[1]], medium="GPU", group_idx=0))
    assert wait_for(lambda: idx.blocks(INST) == 1)
    assert idx.match(INST, chain(toks, BS, salt="tenant-a")) == 1


def test_unknown_parent_counted_and_skipped(make_pub, make_sub):
    pub, ep, rep, _ = make_pub()
    idx = BlockIndex(BS)
    sub = make_sub(INST, ep, idx, rep)
    toks = list(range(20, 20 + 3 * BS))
    e = engine_hashes(toks)
    publish(pub, stored(e[1:], e[0], toks[BS:]))  # e[0] was never published
    publish(pub, stored([b"\x02" * 32], None, toks[:BS]))
    assert wait_for(lambda: sub.stats()["last_seq"] == 1)
    st = sub.stats()
    assert st["unknown_parent"] == 2 and st["stale"] is False
    assert idx.blocks(INST) == 1 and idx.match(INST, chain(toks, BS)) == 1


def test_gap_is_replayed(make_pub, make_sub):
    pub, ep, rep, _ = make_pub()
    idx = BlockIndex(BS)
    sub = make_sub(INST, ep, idx, rep)
    toks = list(range(300, 300 + 4 * BS))
    e = engine_hashes(toks)
    publish(pub, stored(e[:1], None, toks[:BS]))
    assert wait_for(lambda: idx.blocks(INST) == 1)
    assert sub.stop()
    for i in (1, 2):  # sent while nobody listens: lost for this subscriber
        publish(pub, stored(e[i:i + 1], e[i - 1], toks[i * BS:(i + 1) * BS]))
    assert wait_for(lambda: pub._event_queue.qsize() == 0)
    time.sleep(0.1)
    sub.start()
    time.sleep(JOIN_S)
    publish(pub, stored(e[3:], e[2], toks[3 * BS:]))
    assert wait_for(lambda: sub.stats()["last_seq"] == 3), sub.stats()
    st = sub.stats()
    assert (st["gaps"], st["replays"], st["replay_failures"], st["stale"]) == (1, 1, 0, False)
    assert idx.match(INST, chain(toks, BS)) == 4


@pytest.mark.parametrize("why", ["no_replay_listener", "replay_buffer_wrapped"])
def test_unrecoverable_gap_marks_stale(make_pub, make_sub, why):
    pub, ep, rep, _ = make_pub(buffer_steps=1 if why == "replay_buffer_wrapped" else 10_000)
    if why == "no_replay_listener":
        rep = f"tcp://127.0.0.1:{free_port()}"
    idx = BlockIndex(BS)
    sub = make_sub(INST, ep, idx, rep, replay_timeout=0.5)
    a, b, c = (list(range(k, k + BS)) for k in (500, 600, 700))
    publish(pub, stored(engine_hashes(a), None, a))
    assert wait_for(lambda: idx.blocks(INST) == 1)
    assert sub.stop()
    publish(pub, stored(engine_hashes(b), None, b))  # lost
    assert wait_for(lambda: pub._event_queue.qsize() == 0)
    time.sleep(0.1)
    sub.start()
    time.sleep(JOIN_S)
    publish(pub, stored(engine_hashes(c), None, c))
    assert wait_for(lambda: sub.stats()["last_seq"] == 2), sub.stats()
    st = sub.stats()
    assert (st["gaps"], st["replays"], st["replay_failures"], st["stale"]) == (1, 0, 1, True)
    assert sub.stale
    assert idx.match(INST, chain(a, BS)) == 0  # cleared: it may have been evicted unseen
    assert idx.match(INST, chain(b, BS)) == 0 and idx.match(INST, chain(c, BS)) == 1
    publish(pub, AllBlocksCleared())  # the engine's cache is empty: exact again
    assert wait_for(lambda: not sub.stale) and idx.blocks(INST) == 0


def test_publisher_restart_resets_view(make_pub, make_sub):
    pub, ep, rep, ports = make_pub()
    idx = BlockIndex(BS)
    sub = make_sub(INST, ep, idx, rep)
    a, b = list(range(BS)), list(range(10, 10 + BS))
    publish(pub, stored(engine_hashes(a), None, a))
    publish(pub, stored(engine_hashes(b), None, b))
    assert wait_for(lambda: idx.blocks(INST) == 2)
    pub.shutdown()
    pub2, *_ = make_pub(ports=ports)  # a restarted engine: same endpoints, seq from 0
    time.sleep(JOIN_S)
    publish(pub2, stored(engine_hashes(b), None, b))
    assert wait_for(lambda: sub.stats()["restarts"] == 1), sub.stats()
    assert wait_for(lambda: idx.blocks(INST) == 1)
    assert idx.match(INST, chain(a, BS)) == 0 and idx.match(INST, chain(b, BS)) == 1
    assert sub.stats()["last_seq"] == 0 and not sub.stale


def test_stop_returns_within_deadline(make_pub, make_sub):
    pub, ep, _, _ = make_pub()
    idx = BlockIndex(BS)
    idle = make_sub(INST, ep, idx)
    t0 = time.monotonic()
    assert idle.stop(timeout=2.0) and time.monotonic() - t0 < 1.0
    # stopping while a replay waits on a dead replay endpoint (its own deadline is 10 s)
    sub = make_sub("other", ep, idx, f"tcp://127.0.0.1:{free_port()}", replay_timeout=10.0)
    a = list(range(BS))
    publish(pub, stored(engine_hashes(a), None, a))
    assert wait_for(lambda: idx.blocks("other") == 1)
    assert sub.stop()
    publish(pub, stored(engine_hashes(a), None, a))  # lost
    assert wait_for(lambda: pub._event_queue.qsize() == 0)
    time.sleep(0.1)
    sub.start()
    time.sleep(JOIN_S)
    publish(pub, stored(engine_hashes(a), None, a))
    assert wait_for(lambda: sub.stats()["gaps"] == 1)
    t0 = time.monotonic()
    assert sub.stop(timeout=2.0)
    assert time.monotonic() - t0 < 1.0


def test_subscriber_binds_where_the_engine_connects(make_sub):
    # An engine given ``tcp://HOST:P`` connects there (vLLM's rule); the subscriber binds it.
    port = free_port()
    addr, bind = subscriber_address(f"tcp://127.0.0.1:{port}", "127.0.0.9")
    assert (addr, bind) == (f"tcp://127.0.0.1:{port}", True)
    assert subscriber_address(f"tcp://*:{port}", "127.0.0.9") == (f"tcp://127.0.0.9:{port}", False)
    assert subscriber_address("ipc:///tmp/x", "127.0.0.9") == ("ipc:///tmp/x", False)
    idx = BlockIndex(BS)
    sub = make_sub(INST, addr, idx, bind=True)
    pub = ZmqEventPublisher(data_parallel_rank=0, endpoint=f"tcp://127.0.0.1:{port}")
    try:
        a = list(range(BS))
        deadline = time.monotonic() + 5
        while idx.blocks(INST) == 0 and time.monotonic() < deadline:  # the engine connects late
            publish(pub, stored(engine_hashes(a), None, a))
            time.sleep(0.2)
        assert idx.match(INST, chain(a, BS)) == 1 and not sub.stale
    finally:
        pub.shutdown()


# -- the store tier's events (medium mooncake) -------------------------------------------
def other_engine_hashes(tokens) -> list:
    """Another engine's hashes of the same blocks (vLLM's differ per process)."""
    out, parent = [], b"another-engine"
    for i in range(0, len(tokens) - BS + 1, BS):
        parent = hashlib.sha256(parent + json.dumps(tokens[i:i + BS]).encode()).digest()
        out.append(parent)
    return out


def test_store_events_fill_one_store_view_shared_by_every_instance(make_pub, make_sub):
    from multi.router.index import STORE

    pa, ep_a, rep_a, ports_a = make_pub()
    pb, ep_b, rep_b, _ = make_pub()
    exact, store = BlockIndex(BS), BlockIndex(BS)
    inst_b = "http://127.0.0.1:8101"
    sa = make_sub(INST, ep_a, exact, rep_a, store=store)
    sb = make_sub(inst_b, ep_b, exact, rep_b, store=store)
    toks = list(range(1000, 1000 + 4 * BS))
    want = chain(toks, BS)
    ea, eb = engine_hashes(toks), other_engine_hashes(toks)
    # A computes the prompt (its own cache), then its store tier confirms chunks [0, 2) and [2, 3).
    publish(pa, stored(ea[:3], None, toks[:3 * BS]))
    publish(pa, stored(ea[:2], None, toks[:2 * BS], medium="mooncake", kind=None),
            stored(ea[2:3], ea[1], toks[2 * BS:3 * BS], medium="mooncake", kind=None))
    assert wait_for(lambda: store.match(STORE, want) == 3), sa.stats()
    assert exact.match(INST, want) == 3 and exact.blocks(STORE) == 0 and store.blocks(INST) == 0
    # B (other engine hashes) stores the next chunk: the same view, in the router's own hashes.
    publish(pb, stored(eb, None, toks), stored(eb[3:], eb[2], toks[3 * BS:], medium="mooncake", kind=None))
    assert wait_for(lambda: store.match(STORE, want) == 4), sb.stats()
    # A found its chunk [2, 3) gone: removed for everyone; B's cache is not touched.
    publish(pa, BlockRemoved(block_hashes=[ea[2]], medium="mooncake", group_idx=0))
    assert wait_for(lambda: store.match(STORE, want) == 2)
    assert exact.match(inst_b, want) == 4 and exact.match(INST, want) == 3
    # Bounds: another group, another block size, unknown hashes: counted, not placed.
    publish(pa, stored(ea[2:3], ea[1], toks[2 * BS:3 * BS], medium="mooncake", group_idx=1, kind=None),
            stored(ea[:1], None, toks[:2 * BS], medium="mooncake", block_size=2 * BS, kind=None),
            BlockRemoved(block_hashes=[b"\x07" * 32, ea[0]], medium="mooncake", group_idx=0))
    assert wait_for(lambda: sa.stats()["last_seq"] == 3)
    st = sa.stats()
    assert (st["ignored_group"], st["block_size_mismatch"], st["store_unmapped"]) == (1, 1, 1), st
    assert (st["store_stored"], st["store_removed"], st["ignored_medium"]) == (3, 2, 0), st
    assert store.match(STORE, want) == 0 and store.blocks(STORE) == 2  # [1, 2) and [3, 4): unreachable
    # B clears its cache and A's publisher restarts: the store's objects outlive both.
    publish(pb, AllBlocksCleared())
    assert wait_for(lambda: exact.blocks(inst_b) == 0)
    pa.shutdown()
    pa2, *_ = make_pub(ports=ports_a)
    time.sleep(JOIN_S)
    publish(pa2, stored(ea[:1], None, toks[:BS]))
    assert wait_for(lambda: sa.stats()["restarts"] == 1)
    assert store.blocks(STORE) == 2 and store.has(STORE, want[3])


def test_store_events_without_a_store_view_are_ignored(make_pub, make_sub):
    pub, ep, rep, _ = make_pub()
    idx = BlockIndex(BS)
    sub = make_sub(INST, ep, idx, rep)
    toks = list(range(50, 50 + BS))
    publish(pub, stored(engine_hashes(toks), None, toks, medium="mooncake", kind=None))
    assert wait_for(lambda: sub.stats()["last_seq"] == 0)
    assert sub.stats()["ignored_medium"] == 1 and idx.blocks(INST) == 0
