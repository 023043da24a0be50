"""Store tier telemetry: one spec shared by the stats record and Prometheus
(metric names ``vllm:mctier_store_<counter>_total{kind=...}``,
``vllm:mctier_store_<op>_seconds`` and ``vllm:mctier_store_phase_seconds{phase=...}``).

The phases split a worker's load and save into what each waits on, so that where the
time goes can be read off any engine's /metrics:

- ``load_queue``: from the step that started the load until the load thread took it;
- ``load_transfer``: Mooncake's batch get of whole chunks straight into the pages (one
  call: the master's replica lookup and the data transfer);
- ``load_staging`` / ``load_copy``: chunks fetched whole into host staging (a scattered
  chunk, several per get; a chunk needed from a later block on, alone), then their pages
  copied into place;
- ``load_recheck``: the master round trip that confirms the loaded objects still exist;
- layer-wise loads (``layerwise_load``, :mod:`mcstore.layerwise`): ``load_session`` (the get
  session's replica lookup at the master), ``load_layer_first`` (the first layer group's ranged
  get), ``load_layers`` (every group's, digests included) and ``load_layer_wait`` (per step, how
  long the forward pass waited in ``wait_for_layer_load`` in all);
- ``save_queue``: from the step that queued the save until the save thread took it
  (includes waiting for the forward pass that writes the pages);
- ``save_exists``: the master round trip that skips chunks (and finds directory entries)
  already stored;
- ``save_transfer``: Mooncake's batch put from the pages (allocation at the master,
  transfer, commit), with the new directory entries of those objects (:mod:`mcstore.saves`);
- ``save_dirs``: upserting the directory entries that could not go with the put (one already
  there is replaced; the first TP rank of the first stage only; :mod:`mcstore.keys`).

``io_ranges`` / ``io_chunks`` (kind = load or save) count the buffer ranges handed to
Mooncake for whole chunks and those chunks: their ratio is the descriptors per chunk,
which grows as a live engine's blocks scatter.
"""

from __future__ import annotations

from kvcore.metrics import MetricSpec, TierStats, prom_class

SPEC = MetricSpec(
    prefix="mctier_store",
    counters={
        "lookups": "Store lookups by outcome (kind=hit|miss|unavailable: the breaker was open|timeout: no answer "
                   "within lookup_timeout_ms|failed: the call failed|short: given up, fewer than "
                   "lookup_defer_min_tokens expected past the prefix cache|gated: not asked, recent lookups "
                   "found too little: lookup_probe_every), each a miss but hit",
        "hit_tokens": "Prompt tokens the store could supply at lookup",
        "partial_hit_tokens": "Of those, the tokens past the whole chunks: leading blocks of another prompt's "
                              "stored chunk or saved tail, found through its directory entry",
        "loads": "Loads planned, by how they run (kind=sync: inside the step that schedules the request, "
                 "sync_load_max; kind=background: while the request waits)",
        "loaded_tokens": "Tokens loaded from the store into KV blocks",
        "loaded_bytes": "Bytes loaded from the store",
        "saved_tokens": "Tokens saved to the store",
        "saved_bytes": "Bytes saved to the store",
        "save_skipped": "Chunks not saved (kind=exists|unavailable)",
        "failures": "Failed store operations by cause (kind=load_<cause>|save_<cause>)",
        "io_chunks": "Whole chunks handed to Mooncake in one batch get or put (kind=load|save)",
        "io_ranges": "Buffer ranges (descriptors) of those chunks (kind=load|save)",
        "resets": "vLLM reset_cache calls (POST /reset_prefix_cache?reset_external=true)",
    },
    ops={
        "lookup": "Duration of one request's store lookup (its batch's round trip to the master)",
        "lookup_wait": "From a request's first lookup call until its answer was used (non-blocking lookups: "
                       "the steps it waited, its batch's round trip included)",
        "load": "Duration of one request's store load",
        "save": "Duration of one save batch",
        "phase": "Time in one phase of a load or save (phase=load_queue|load_transfer|load_staging|"
                 "load_copy|load_recheck|load_session|load_layer_first|load_layers|load_layer_wait|save_queue|"
                 "save_exists|save_transfer|save_dirs)",
    },
    op_labels={"phase": "phase"},
)


class StoreStats(TierStats):
    pass


StorePromMetrics = prom_class(SPEC)
