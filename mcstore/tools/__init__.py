"""Operator tools on the store tier: inspection (:mod:`.inspect` API, :mod:`.inspect_cli`,
:mod:`.inspect_http`) and warmup (:mod:`.warmup`, :mod:`.warmup_cli`, :mod:`.warmup_runners`).

They sit above the tier: they use :mod:`mcstore` (keys, config, :class:`mcstore.client.StoreClient`
and its breaker, the metadata engines publish) and ``mcstore`` never imports them. An
engine's key space comes from what its connector published when it started, found from the
engine's URL or model name (:mod:`.published`), or from its settings (:mod:`.engine`, with
the vLLM side in :mod:`kvcore.vllm_layout`). Human output (tables, byte counts): :mod:`.format`.
"""
