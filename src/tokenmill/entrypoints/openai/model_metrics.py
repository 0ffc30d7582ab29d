"""GET /metrics with several models: every model's own series, each sample labelled `model`, plus
tokenmill:model_loaded (1 loaded, 0 not) and tokenmill:model_requests_in_flight per model.

Each loaded model keeps its own ServerMetrics (its own registry, as with one model); this merges
their families so that each metric name appears once in the exposition, as Prometheus requires.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import prometheus_client
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.samples import Sample

from tokenmill.entrypoints.openai.metrics import ServerMetrics
from tokenmill.frontend.model_router import ModelRouter, ModelState


class _ModelsCollector:
    def __init__(self, loaded: Mapping[str, ServerMetrics], router: ModelRouter) -> None:
        self._loaded = loaded
        self._router = router

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("tokenmill:model_loaded", "Model loaded (1) or not (0)", labels=["model"])
        busy = GaugeMetricFamily("tokenmill:model_requests_in_flight", "Requests routed to the model, unfinished",
                                 labels=["model"])
        for entry in self._router.entries.values():
            up.add_metric([entry.name], 1.0 if entry.state is ModelState.LOADED else 0.0)
            busy.add_metric([entry.name], float(entry.in_flight))
        yield up
        yield busy
        merged: dict[str, Metric] = {}
        for name, metrics in self._loaded.items():
            for family in metrics.registry.collect():
                target = merged.get(family.name)
                if target is None:
                    target = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                target.samples.extend(Sample(s.name, {**s.labels, "model": name}, s.value, s.timestamp, s.exemplar)
                                      for s in family.samples)
        yield from merged.values()


def render_models(loaded: Mapping[str, ServerMetrics], router: ModelRouter) -> bytes:
    registry = CollectorRegistry()
    registry.register(_ModelsCollector(loaded, router))
    return prometheus_client.generate_latest(registry)
