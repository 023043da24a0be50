"""A discrete-event cluster simulator that runs the project's own router and cost model.

- :mod:`bench.sim.speeds`: the instances' speed models and the cluster presets (sources);
- :mod:`bench.sim.cluster`: engines, prefix caches, the store, the event loop;
- :mod:`bench.sim.router`: the product's :class:`multi.router.choose.Chooser` over them, :func:`simulate`;
- :mod:`bench.sim.report`: one run's figures (TTFT, TPOT, SLO attainment, reuse by tier);
- ``python -m bench.sim``: the cluster runs and the validation against a real replay.
"""
