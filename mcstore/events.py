"""The store tier's KV events: what it stored and lost, on the engine's own KV event stream.

With ``--kv-events-config`` events on, the tier publishes through vLLM's ``take_events``, in
vLLM's own event classes (:func:`kvcore.vllm_events.block_stored_event`), with medium
:data:`MEDIUM` and the request's vLLM block hashes, token ids and extra keys, group 0 (one
event per chunk, announced once every KV cache group's objects of it are in), so any subscriber of the engine's stream (vLLM's
``KVEventBatch`` decoder, llm-d, Dynamo, ``mctier proxy``) reads them as the engine's own:

- ``BlockStored`` of a chunk's blocks once its save is confirmed: the scheduler keeps the event
  when it plans the save (:meth:`StoreEvents.planned`), each worker reports the chunk parts it
  wrote in its per-step metadata (:class:`StoreWorkerMeta`, vLLM joins the ranks'), and the
  chunk is announced when every part (every TP rank of every pipeline stage, of every KV cache
  group) is in;
- ``BlockRemoved`` of a chunk this engine announced, when the tier learns it is gone: a load
  found it missing (evicted, lease expired), a lookup found it absent, or ``reset_cache``
  removed the engine's objects.

Bounded: at most :data:`PLANNED_MAX` saves wait for confirmation (a request's unconfirmed ones
are dropped when vLLM reports its saves ended) and :data:`ANNOUNCED_MAX` announced chunks are
remembered for their removal (the oldest forgotten first). With events off nothing is kept.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvcore.vllm_events import block_removed_event, block_stored_event
from kvcore.vllm_glue import KVConnectorWorkerMetadata

MEDIUM = "mooncake"
PLANNED_MAX = 4096  # chunks: the worker's save queue holds as many (StoreConfig.save_queue_chunks)
ANNOUNCED_MAX = 8192


@dataclass
class StoreWorkerMeta(KVConnectorWorkerMetadata):
    """A step's news from the store workers: chunk parts written ``(link, part)`` and chunks a
    load found gone (links); a part is ``pp_rank * tp_size + tp_rank``."""

    stored: list[tuple[str, int]] = field(default_factory=list)
    gone: list[str] = field(default_factory=list)
    saved: list[int] = field(default_factory=list)  # save jobs ended on this rank, by pin (mcstore.groups)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, StoreWorkerMeta):
            self.stored += other.stored
            self.gone += other.gone
            self.saved += other.saved
        return self


class WorkerNews:
    """Worker side (a mixin of :class:`mcstore.worker.StoreWorker`, whose lock, ``events``,
    ``part`` and ``_news`` it uses): what was written and what was found gone, per step."""

    def worker_meta(self) -> StoreWorkerMeta | None:
        """The chunk parts written and the chunks found gone (with events on), and the pinned save
        jobs that ended, since the last call (None when there are none)."""
        with self._lock:
            if not (self._news.stored or self._news.gone or self._news.saved):
                return None
            out, self._news = self._news, StoreWorkerMeta()
        return out

    def _news_of(self, stored_keys: list[str] = (), gone_links: list[str] = ()) -> None:
        """Object keys of parts written (``{link}/{part}``), links of chunks found gone."""
        if self.events:
            with self._lock:
                self._news.stored += [(link, self.keys.part_of(self.rank, group=_group_of(suffix)))
                                      for link, suffix in (k.rsplit("/", 1) for k in stored_keys)]
                self._news.gone += gone_links

    def _job_ended(self, job) -> None:
        """A save job ended here (written, failed or dropped): its pinned blocks may go."""
        if job.pin >= 0:
            with self._lock:
                self._news.saved.append(job.pin)


def _group_of(suffix: str) -> int:
    """The KV cache group an object key's last part names (``g{group}tp{rank}``; 0 if none)."""
    return int(suffix[1:suffix.index("p")]) if suffix.startswith("g") else 0


class StoreEvents:
    """Scheduler side: the events of planned saves until confirmed, and what was announced."""

    def __init__(self, parts: int, block_size: int, chunk_blocks: int):
        self.parts, self.block_size, self.chunk_blocks = parts, block_size, chunk_blocks
        self._planned: OrderedDict[str, tuple[object, set[int]]] = OrderedDict()  # link -> (event, parts in)
        self._by_req: dict[str, list[str]] = {}
        self._announced: OrderedDict[str, list] = OrderedDict()  # link -> its blocks' external hashes
        self._out: list = []

    def planned(self, req_id: str, link: str, index: int, request) -> None:
        """A save of chunk ``index`` (``link``) of ``request`` was planned."""
        ev = block_stored_event(request, index * self.chunk_blocks, (index + 1) * self.chunk_blocks,
                                self.block_size, MEDIUM)
        if ev is None:
            return
        self._planned[link] = (ev, set())
        self._planned.move_to_end(link)
        self._by_req.setdefault(req_id, []).append(link)
        while len(self._planned) > PLANNED_MAX:
            self._planned.popitem(last=False)

    def worker_news(self, meta) -> None:
        if not isinstance(meta, StoreWorkerMeta):
            return
        for link, part in meta.stored:
            entry = self._planned.get(link)
            if entry is None:
                continue
            entry[1].add(part)
            if len(entry[1]) >= self.parts:
                del self._planned[link]
                self._out.append(entry[0])
                self._announced[link] = entry[0].block_hashes
                self._announced.move_to_end(link)
                while len(self._announced) > ANNOUNCED_MAX:
                    self._announced.popitem(last=False)
        for link in meta.gone:
            self.gone(link)

    def gone(self, link: str) -> None:
        """``link``'s chunk is no longer in the store: removed, if this engine announced it."""
        hashes = self._announced.pop(link, None)
        if hashes is not None:
            self._out.append(block_removed_event(hashes, MEDIUM))

    def request_done(self, req_id: str) -> None:
        """The request's saves ended: what is still unconfirmed was not written."""
        for link in self._by_req.pop(req_id, ()):
            self._planned.pop(link, None)

    def removed_all(self) -> None:
        """Every chunk this engine announced was removed (``reset_cache`` with removal)."""
        for hashes in self._announced.values():
            self._out.append(block_removed_event(hashes, MEDIUM))
        self._announced.clear()

    def take(self) -> list:
        out, self._out = self._out, []
        return out
