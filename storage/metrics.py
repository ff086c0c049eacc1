"""Prometheus metrics of one daemon, on its own registry (no global registry, no multiprocess mode).

Values that already live in the daemon (steps and bytes held, counters it keeps) are read at
scrape time from its :class:`~storage.protocol.Snapshot` by :class:`SnapshotCollector`; latencies
are histograms observed as they happen (:class:`Latencies`). Every series has the labels ``job``
and ``host``, never a step number. Only daemons export metrics.

    ecsnap serve --metrics-port 9400          # virtual host i serves on 9400 + i
    ecsnap serve --metrics-port 0             # a free port, written to <host dir>/metrics.port
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from storage.protocol import Snapshot

__all__ = ["Endpoint", "Latencies", "ProcessMetrics", "SnapshotCollector"]

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Latencies:
    """The daemon's registry and the histograms its modules observe."""

    def __init__(self, job: str, host: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["job", "host"]

        def histogram(name: str, doc: str) -> Any:
            return Histogram(
                name, doc, labels, registry=self.registry, buckets=_LATENCY_BUCKETS
            ).labels(job, host)

        self.stage = histogram("ecsnap_stage_seconds", "Trainer's alloc to staged (put->staged)")
        self.protect = histogram(
            "ecsnap_protect_seconds", "Trainer's alloc to protected (put->protected)"
        )
        self.rebuild = histogram("ecsnap_rebuild_seconds", "Time to repair one step's chunks")


class ProcessMetrics(Collector):
    """prometheus_client's process collector (``process_resident_memory_bytes``,
    ``process_cpu_seconds_total``, ``process_open_fds`` against ``process_max_fds``...) with the
    ``job`` and ``host`` labels every series here carries: virtual hosts share one scrape
    target's address, and an alert names the daemon."""

    def __init__(self, job: str, host: str) -> None:
        self._inner = ProcessCollector(registry=None)
        self._labels = {"job": job, "host": host}

    def collect(self) -> Iterator[Metric]:
        for family in self._inner.collect():
            out = Metric(family.name, family.documentation, family.type, family.unit)
            for sample in family.samples:
                out.add_sample(
                    sample.name, {**sample.labels, **self._labels}, sample.value, sample.timestamp
                )
            yield out


class SnapshotCollector(Collector):
    """Reads the daemon's :class:`Snapshot` when Prometheus scrapes."""

    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot()
        names = ["job", "host"]
        labels = [snap.job, snap.host]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(labels, value)
            return c

        def by(
            kind: type[GaugeMetricFamily] | type[CounterMetricFamily],
            name: str,
            doc: str,
            label: str,
            values: dict[str, float],
        ) -> Metric:
            """One family with a label more, a sample per value of it (in the order given)."""
            f = kind(name, doc, labels=[*names, label])
            for key, value in values.items():
                f.add_metric([*labels, key], value)
            return f

        stats = snap.stats
        yield gauge(
            "ecsnap_latest_protected_step",
            "Newest protected step (NaN before the first)",
            math.nan if snap.latest is None else snap.latest,
        )
        yield gauge("ecsnap_steps_held", "Protected steps held", len(snap.protected))
        yield gauge(
            "ecsnap_ahead_bytes",
            "Shared memory made ahead of need for the next puts (free files, reserve aside); "
            "at most two puts of the newest sizes (README, 'What a host holds')",
            snap.stats.get("pool_ahead_free_bytes", 0),
        )
        yield gauge(
            "ecsnap_steps_in_flight",
            "Steps being put on this host: in a lane, or allocated or staged here and not yet "
            "taken by a round",
            len(snap.in_flight),
        )
        yield gauge(
            "ecsnap_oldest_in_flight_seconds",
            "Age of the oldest step in flight here (0 with none): one that grows is stuck",
            max((f["age_s"] for f in snap.in_flight), default=0.0),
        )
        yield counter(
            "ecsnap_steps_protected",
            "Steps this daemon saw become protected",
            stats["steps_protected"],
        )
        yield by(
            GaugeMetricFamily,
            "ecsnap_stored_bytes",
            "Bytes of protected steps held here",
            "kind",
            {"data": snap.data_bytes, "parity": snap.parity_bytes},
        )
        yield gauge(
            "ecsnap_shm_bytes", "Shared memory this daemon holds, in use or free", snap.pool_bytes
        )
        yield gauge(
            "ecsnap_memory_budget_bytes",
            "Shared memory this host may hold: --memory-budget, else what /dev/shm (the file "
            "system under --root) holds",
            snap.memory_limit,
        )
        yield by(
            CounterMetricFamily,
            "ecsnap_shm_faulted_bytes",
            "Shared memory faulted in (fresh pages): inside a put's take, or ahead of need "
            "(the next puts' files and --reserve, made in idle time)",
            "when",
            {"in_put": stats["pool_fresh_bytes"], "ahead": stats["pool_ahead_bytes"]},
        )
        yield gauge(
            "ecsnap_reserve_free_bytes",
            "Reserve files (--reserve) not yet turned into the files puts need",
            stats["reserve_free_bytes"],
        )
        yield by(
            CounterMetricFamily,
            "ecsnap_put_bytes",
            "Bytes of the shards trainers put here: copied into shared memory, or stored as "
            "references to bytes a held step already has (tensors unchanged since the last put)",
            "how",
            {"copied": stats["staged_bytes"], "referenced": stats["referenced_bytes"]},
        )
        yield gauge(
            "ecsnap_pinned_steps",
            "Steps gone for readers that this host's group keeps: later steps refer to them",
            stats["pinned_steps"],
        )
        yield counter(
            "ecsnap_encode_bytes", "Data bytes encoded into parity", stats["encode_bytes"]
        )
        yield counter("ecsnap_encode_seconds", "Seconds spent encoding", stats["encode_seconds"])
        yield by(
            CounterMetricFamily,
            "ecsnap_cpu_seconds",
            "CPU seconds by phase: this daemon's threads (other: its process time no phase "
            "claimed), and its trainers' staging copies and hashing (stage, hash); see storage.cpu",
            "phase",
            snap.cpu,
        )
        yield counter(
            "ecsnap_decode_bytes", "Bytes read to decode lost chunks", stats["decode_bytes"]
        )
        yield counter(
            "ecsnap_network_sent_bytes", "Payload bytes sent to peer daemons", snap.sent_bytes
        )
        yield counter(
            "ecsnap_network_received_bytes",
            "Payload bytes received from peers",
            snap.received_bytes,
        )
        yield counter(
            "ecsnap_checksum_failures",
            "Chunks or manifests whose bytes were there but failed their checksum (corruption)",
            stats["checksum_failures"],
        )
        yield counter(
            "ecsnap_missing_chunks",
            "Chunks whose file was gone or short (a lost or replaced host)",
            stats["missing_chunks"],
        )
        yield gauge(
            "ecsnap_degraded_stripes",
            "Stripes with lost chunks not yet rebuilt",
            snap.degraded_stripes,
        )
        yield counter("ecsnap_rebuilds", "Repairs of a step's lost chunks", stats["rebuilds"])
        yield counter(
            "ecsnap_rebuilt_chunks", "Chunks rebuilt on this host", stats["rebuilt_chunks"]
        )
        yield gauge(
            "ecsnap_lost_steps", "Steps that lost more than m chunks of a stripe", len(snap.lost)
        )
        yield by(
            CounterMetricFamily,
            "ecsnap_errors",
            "Requests refused, by error",
            "kind",
            dict(sorted(snap.errors.items())),
        )
        yield by(
            GaugeMetricFamily,
            "ecsnap_hosts",
            "Hosts of the job, by state",
            "state",
            {"up": snap.hosts_up, "missing": snap.hosts_missing},
        )
        yield by(
            GaugeMetricFamily,
            "ecsnap_health",
            "1 for the daemon's current health",
            "state",
            {
                s: 1.0 if snap.health == s else 0.0
                for s in ("starting", "rebuilding", "healthy", "unreachable peer", "failed")
            },
        )
        yield by(
            CounterMetricFamily,
            "ecsnap_accept_errors",
            "Accepts of the control socket that failed and were tried again after a back-off "
            "(EMFILE, ENFILE: out of descriptors; ENOBUFS, ENOMEM; threads: none to be had)",
            "errno",
            dict(sorted(snap.accept_errors.items())),
        )


class Endpoint:
    """The HTTP endpoint serving one registry's ``/metrics``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.server: Any = None
        self.port: int | None = None

    def serve(self, port: int, addr: str, port_file: Path) -> int:
        """Serve ``/metrics`` on ``addr:port`` (0: any free port); write the port to a file."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        self.server = server
        self.port = int(server.server_port)
        port_file.write_text(f"{self.port}\n")
        port_file.chmod(0o600)
        return self.port

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
