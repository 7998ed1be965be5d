"""Cluster-wide gateway figures when several gateways serve one fleet
(``tandem serve --api-server-count N``, ``cluster/cli/gateways.py``).

What a gateway measures itself (requests, tokens, latency histograms,
finish reasons, rejections: ``GatewayMetrics``; its view of the others'
shared in-flight records: ``peer_load_metrics.py``) is its own slice; the
engines' figures, and the router's per-engine in-flight figures that add
every gateway's, are already the same on every gateway (each polls every
engine; the routers share their counts, ``cluster/routing/peer_load.py``).
So that ``/metrics`` and ``/cluster/state`` answer the same on every
gateway, each one publishes its slice about once a second into a directory
its supervisor gives all of them, one file per gateway index (written
whole, then renamed over the old one):

    <dir>/gateway-<i>.json   {"index", "pid", "time_s", "metrics": exposition text,
                              "counters": {requests_in_flight, finished, rejected, ...}}

(``load-<i>.sock`` beside them are the routers' datagram sockets for their
per-engine in-flight counts, sent on change: ``cluster/routing/peer_load.py``)

and ``/metrics`` shows every gateway's families with a ``gateway="<i>"``
label (its own live, the others as last published: at most about a second
old); ``/cluster/state`` sums the counters and lists them per gateway. A
restarted gateway takes its predecessor's file's counters as the start of
its ``/cluster/state`` counters, so the cluster's totals there never go
back; its Prometheus series start again from 0 (``rate`` takes that as a
counter reset). The rolling window of ``/cluster/state`` (tokens/s, latency
percentiles) is the cluster's too: each file also carries the gateway's
cumulative window values (``"rolling"``, ``dashboard/rolling.py``, continued
from its predecessor's like the counters), which every gateway adds to its
own at each sample. A file not rewritten for
``STALE_AFTER_S`` belongs to a gateway that is gone: its counters still
count, its in-flight figure does not.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

SHARE_DIR_ENV = "TANDEM_GATEWAY_SHARE_DIR"
PUBLISH_INTERVAL_S = 1.0
STALE_AFTER_S = 10.0


class GatewayPeers(Collector):
    """This gateway's share of the cluster's gateway figures. ``metrics``:
    its ``GatewayMetrics``; ``snapshot()`` returns its own counters."""

    def __init__(
        self, directory: str, index: int, metrics: Any, others: tuple[Collector, ...] = ()
    ) -> None:
        """``others``: more collectors of this gateway's own figures."""
        self.directory = directory
        self.index = index
        self.metrics = metrics
        self._registry = CollectorRegistry()
        for c in (metrics, *others):
            self._registry.register(c)
        self._timer: asyncio.TimerHandle | None = None
        self._predecessor = self._predecessor_record()
        self.base = self._predecessor.get("counters", {})
        # more fields of this gateway's record: name -> JSON-able value, read at each publish
        self.published: dict[str, Callable[[], Any]] = {}

    # ---- publishing ----------------------------------------------------------

    def path(self, index: int) -> str:
        return os.path.join(self.directory, f"gateway-{index}.json")

    def _predecessor_record(self) -> dict[str, Any]:
        """What the gateway of this index had published before it died."""
        try:
            with open(self.path(self.index)) as f:
                old = json.load(f)
        except (OSError, ValueError):
            return {}
        return old if isinstance(old, dict) else {}

    def predecessor(self, name: str) -> Any:
        """Field ``name`` of the predecessor's last record (None without one):
        where this gateway's cumulative figures start."""
        return self._predecessor.get(name)

    def counters(self) -> dict[str, Any]:
        m = self.metrics
        return {
            "requests_in_flight": m.num_requests_in_flight,
            "prompt_tokens": m.num_prompt_tokens + self.base.get("prompt_tokens", 0),
            "generation_tokens": m.num_generation_tokens + self.base.get("generation_tokens", 0),
            "finished": _add(m.num_finished, self.base.get("finished", {})),
            "rejected": _add(m.num_rejected, self.base.get("rejected", {})),
        }

    def publish(self) -> None:
        record = {
            "index": self.index,
            "pid": os.getpid(),
            "time_s": time.time(),
            "metrics": generate_latest(self._registry).decode(),
            "counters": self.counters(),
            **{name: value() for name, value in self.published.items()},
        }
        tmp = self.path(self.index) + f".{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, self.path(self.index))

    def ensure_started(self) -> None:
        """Publish now and about every second on the running loop (a timer
        chain, nothing to cancel at shutdown); a no-op without a loop."""
        if self._timer is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._tick(loop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            self.publish()
        except Exception:  # noqa: BLE001 - the next tick tries again
            logger.exception("publishing this gateway's figures failed")
        self._timer = loop.call_later(PUBLISH_INTERVAL_S, self._tick, loop)

    # ---- reading -----------------------------------------------------------------

    def peers(self) -> list[dict[str, Any]]:
        """The other gateways' latest records, by index."""
        out = []
        try:
            names = sorted(os.listdir(self.directory))
        except OSError:
            return out
        for name in names:
            if not (name.startswith("gateway-") and name.endswith(".json")):
                continue
            if name == os.path.basename(self.path(self.index)):
                continue
            try:
                with open(os.path.join(self.directory, name)) as f:
                    out.append(json.load(f))
            except (OSError, ValueError):
                continue  # being replaced: the next read sees it
        return out

    def gateway_rows(self) -> list[dict[str, Any]]:
        """Every gateway's counters (this one's live), by index; a gateway
        gone stale keeps its counters with no request in flight."""
        now = time.time()
        rows = [{"index": self.index, "pid": os.getpid(), "live": True, **self.counters()}]
        for rec in self.peers():
            live = now - rec.get("time_s", 0.0) < STALE_AFTER_S
            counters = dict(rec.get("counters", {}))
            if not live:
                counters["requests_in_flight"] = 0
            rows.append(
                {"index": rec.get("index"), "pid": rec.get("pid"), "live": live, **counters}
            )
        return sorted(rows, key=lambda r: r["index"])

    def collect(self) -> Iterator[Metric]:
        """Every gateway's ``GatewayMetrics`` families, labelled ``gateway``."""
        texts = [(self.index, generate_latest(self._registry).decode())]
        texts += [(rec.get("index"), rec.get("metrics", "")) for rec in self.peers()]
        families: dict[str, Metric] = {}
        for index, text in texts:
            for family in text_string_to_metric_families(text):
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(
                        family.name, family.documentation, family.type, family.unit
                    )
                for s in family.samples:
                    labels = {"gateway": str(index), **s.labels}
                    merged.add_sample(s.name, labels, s.value, s.timestamp, s.exemplar)
        yield from families.values()

    def describe(self) -> list[Metric]:
        return []


def _add(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    out = dict(b)
    for k, v in a.items():
        out[k] = out.get(k, 0) + v
    return out


def cluster_counters(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The gateways' counters summed (``/cluster/state``)."""
    total: dict[str, Any] = {"requests_in_flight": 0, "finished": {}, "rejected": {}}
    for r in rows:
        total["requests_in_flight"] += r.get("requests_in_flight", 0)
        total["finished"] = _add(r.get("finished", {}), total["finished"])
        total["rejected"] = _add(r.get("rejected", {}), total["rejected"])
    return total
