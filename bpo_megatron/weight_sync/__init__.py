"""Trainer → rollout-engine weight sync: the generic seam between the trainer and the engines.

* :mod:`~bpo_megatron.weight_sync.plan`: what every sync of an engine group does (transport,
  bucket size, dtype, quantized form, check), made once from the config;
* :mod:`~bpo_megatron.weight_sync.transport`: what a transport is (``prepare(endpoints)``,
  ``send(buckets, version)``, ``close()``) and the endpoint records it receives;
* :mod:`~bpo_megatron.weight_sync.sender`: a trainer rank's side (export → dtype → quantized
  form → fingerprints → delta → send);
* :mod:`~bpo_megatron.weight_sync.delta`: a delta sync (``weight_sync.delta``): the sending rank's
  record of what the engines hold, each bucket's diff against it, and how an engine applies it;
* :mod:`~bpo_megatron.weight_sync.session`: the driver's owner of an engine group's syncs
  (``WeightSync``), which opens each engine's update session, gathers the engines' endpoints,
  lets the trainer's ranks send, closes the sessions and replaces engines lost on the way;
* :mod:`~bpo_megatron.weight_sync.object_store`: the one transport no engine owns: trainer rank 0
  puts each bucket of host tensors into Ray's object store once; every engine actor loads it
  (vLLM; the embedded engine's engines off the trainer's node).

An engine's own transports live in its folder and are declared by its spec
(``EngineSpec.transports``: name -> ``module:Class``); the driver hands the trainer's ranks that
dotted path, so nothing here names an engine: :func:`transport_class` takes a generic transport's
name (:data:`TRANSPORTS`) or a declared ``module:Class``. The engines' endpoint details a
transport reads are opaque here (``EngineEndpoint.details``).
"""

from __future__ import annotations

import importlib

from bpo_megatron.registry import LazyRegistry

# the generic transports, by name; an engine's own are passed as the "module:Class" its spec declares
TRANSPORTS = LazyRegistry({
    "object_store": "bpo_megatron.weight_sync.object_store:ObjectStore",
}, unknown="no weight transport {name!r}; the generic ones are {sorted}, and an engine's own is given as the "
           "'module:Class' its spec declares")


def transport_class(ref: str) -> type:
    """The transport ``ref`` names: a generic one by name, or an engine's as ``module:Class``."""
    if ref in TRANSPORTS or ":" not in ref:
        return TRANSPORTS.load(ref)
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)
