"""The KV-aware router behind ``mctier proxy``: its own process, in front of vLLM instances.

It sends each request to where its prompt's KV already lives (an instance's prefix cache,
the shared store), weighed against each instance's load with the composite's cost model
(:mod:`multi.policy`, fitted online per instance), hands P/D requests off over the P2P
tier's proxy contract (:mod:`p2p.proxy`), and rejects early what cannot meet its
time-to-first-token target.

Modules (importing this package imports none of them, and nothing here imports vLLM):

- :mod:`multi.router.cli`: ``mctier proxy``'s arguments (:func:`~multi.router.cli.build_parser`)
  and ``main``, which builds the app;
- :mod:`multi.router.app`: the HTTP app, :class:`~multi.router.app.Router` (lifecycle,
  health, handlers, the index and store views);
- :mod:`multi.router.forward`: executing a chosen route (retries, bookkeeping, what it
  teaches the index and the cost model, the decision log);
- :mod:`multi.router.choose`: :class:`~multi.router.choose.Route`, the estimates and the choice;
- :mod:`multi.router.admission`: the TTFT target of a request and the reject decision;
- :mod:`multi.router.index`: :class:`~multi.router.index.BlockIndex` and the router's
  block hash :func:`~multi.router.index.chain`;
- :mod:`multi.router.events`: :class:`~multi.router.events.EventSubscriber`, an engine's
  KV events into the index;
- :mod:`multi.router.eventwire`: vLLM's KV event wire format, decoded without vLLM;
- :mod:`multi.router.instances`: :class:`~multi.router.instances.Instance`,
  :class:`~multi.router.instances.Pool`, the instances file and health checks;
- :mod:`multi.router.prompts`: :class:`~multi.router.prompts.Prompts`, a request's token ids;
- :mod:`multi.router.storeview`: :class:`~multi.router.storeview.StoreIndex`, what the store
  tier's KV events say the store holds, and :class:`~multi.router.storeview.StoreView`, the
  store's reach from the store tier's own lookup, which confirms it;
- :mod:`multi.router.metrics`: :class:`~multi.router.metrics.RouterMetrics`, its ``/metrics``.
"""
