"""``GET /metrics``: the leader in Prometheus' text format, through ``prometheus_client``.

Two kinds of figures:

- what happened, counted as each finished request settles (``observe``, called by swarm.leader.serving.history once the
  stages' times have come in): requests by model and outcome, prompt and reply tokens, and histograms of the queue
  wait, the time to first token, the time per reply token, and each stage's compute and each hop's link time per
  token (from the reply's swarm.timing);
- what is, read at scrape time (``_Live``): requests waiting and running per model, KV tokens held against the
  ring's budget, models by status, fellows by state.

The registry is the leader's own (not prometheus_client's global one), so several leaders in one process -- tests --
keep their figures apart. Scrapes need an admin (API token or session) or the SWARM_METRICS_TOKEN bearer token.
"""

from __future__ import annotations

import hmac
import logging
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response

from swarm.errors import AuthError, Forbidden
from swarm.leader.api.auth import bearer, current_user
from swarm.leader.api.http_errors import api_error

if TYPE_CHECKING:
    from swarm.store.history import ServedRequest

log = logging.getLogger(__name__)

# Seconds. Replies on home PCs range from a few ms per token on a GPU to seconds on a busy CPU ring.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
PER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Metrics:
    """The leader's metrics registry: counters and histograms fed by finished requests, gauges read live."""

    def __init__(self, leader=None):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("swarm_requests", "Requests that ended, by model and outcome (done, failed, "
                                "cancelled).", ["model", "outcome"], registry=r)
        self.prompt_tokens = Counter("swarm_prompt_tokens", "Prompt tokens of the requests that ended.", ["model"],
                                     registry=r)
        self.reply_tokens = Counter("swarm_reply_tokens", "Reply (completion) tokens of the requests that ended.",
                                    ["model"], registry=r)
        self.queue = Histogram("swarm_queue_wait_seconds", "Time a request waited for room on the ring.", ["model"],
                               buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("swarm_time_to_first_token_seconds", "From a request's arrival to its first token "
                              "(queue included).", ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.per_token = Histogram("swarm_time_per_token_seconds", "Time per reply token after the first, per "
                                   "request.", ["model"], buckets=PER_TOKEN_BUCKETS, registry=r)
        self.stage_compute = Histogram("swarm_stage_compute_seconds_per_token", "A stage's compute per reply token, "
                                       "as the stage measured it, per request.", ["model", "stage"],
                                       buckets=PER_TOKEN_BUCKETS, registry=r)
        self.link = Histogram("swarm_link_seconds_per_token", "A hop's share of the ring's link time per reply "
                              "token, per request.", ["model", "hop", "transport"], buckets=PER_TOKEN_BUCKETS,
                              registry=r)
        self.verify_checks = Counter("swarm_verification_checks", "Passes recomputed by another fellow and compared "
                                     "(SWARM_SERVE_VERIFY).", ["model", "stage"], registry=r)
        self.verify_failures = Counter("swarm_verification_failures", "Checked passes whose output was outside the "
                                       "tolerance, by the fellow that computed them.", ["model", "stage", "fellow"],
                                       registry=r)
        if leader is not None:
            r.register(_Live(leader))

    def observe(self, record: ServedRequest) -> None:
        """Count one finished request (its record settled: the fellows' times are in). Never raises."""
        try:
            self._observe(record)
        except Exception:  # a malformed timing map must not cost the serving history
            log.exception("could not count request %s in the metrics", record.id)

    def _observe(self, record: ServedRequest) -> None:
        model = record.model
        self.requests.labels(model, record.outcome).inc()
        self.prompt_tokens.labels(model).inc(record.prompt_tokens)
        self.reply_tokens.labels(model).inc(record.reply_tokens)
        if record.queue_ms is not None:
            self.queue.labels(model).observe(record.queue_ms / 1000)
        if record.ttft_ms is not None:
            self.ttft.labels(model).observe(record.ttft_ms / 1000)
        if record.tokens_per_s:
            self.per_token.labels(model).observe(1 / record.tokens_per_s)
        timing = record.timing or {}
        for stage in timing.get("stages") or []:
            ms = stage.get("compute_ms_per_token")
            if _is_number(ms):
                self.stage_compute.labels(model, str(stage.get("stage"))).observe(ms / 1000)
        for link in timing.get("links") or []:
            ms = link.get("ms_per_token")
            if _is_number(ms):
                hop = f"{link.get('from_stage')}->{link.get('to_stage')}"
                self.link.labels(model, hop, str(link.get("transport") or "unknown")).observe(ms / 1000)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class _Live(Collector):
    """Gauges read from the leader's state at each scrape (trio is single-threaded: the scrape runs on the loop)."""

    def __init__(self, leader):
        self.leader = leader

    def describe(self):
        return []  # read live; nothing to check at registration

    def collect(self):
        serving = self.leader.serving
        book = serving.book
        waiting = GaugeMetricFamily("swarm_requests_waiting", "Requests waiting for room on the ring.",
                                    labels=["model"])
        running = GaugeMetricFamily("swarm_requests_running", "Requests running on the ring.", labels=["model"])
        kv_used = GaugeMetricFamily("swarm_kv_tokens_used", "KV cache tokens the running requests hold (prompt and "
                                    "reply budget) on every stage.", labels=["model"])
        kv_total = GaugeMetricFamily("swarm_kv_tokens_capacity", "KV cache tokens every stage of the ring can hold "
                                     "at once.", labels=["model"])
        status = GaugeMetricFamily("swarm_model_status", "1 for each model's current status.",
                                   labels=["model", "status"])
        stages = GaugeMetricFamily("swarm_model_stages", "Stages a loaded model is split into.", labels=["model"])
        names = set(serving.models) | set(book.waiting)
        for name in sorted(names):
            waiting.add_metric([name], book.queued(name))
            of_model = book.of_model(name)
            running.add_metric([name], len(of_model))
            kv_used.add_metric([name], sum(r.need for r in of_model))
            budget = book.budgets.get(name)
            if budget is not None:
                kv_total.add_metric([name], budget.tokens)
            model = serving.models.get(name)
            if model is not None:
                status.add_metric([name, model.status], 1)
                stages.add_metric([name], len(model.stages))
        fellows = GaugeMetricFamily("swarm_fellows", "Fellows by state: serving (holds a stage or a hot cover), "
                                    "standby, idle (online, nothing held).", labels=["state"])
        counts = {"serving": 0, "standby": 0, "idle": 0}
        for conn in list(self.leader.hub.online.values()):
            if serving.models_on_fellow(conn.id):
                counts["serving"] += 1
            elif conn.standby:
                counts["standby"] += 1
            else:
                counts["idle"] += 1
        for state, count in counts.items():
            fellows.add_metric([state], count)
        yield from (waiting, running, kv_used, kv_total, status, stages, fellows)


class MetricsRoute:
    """The ``/metrics`` endpoint: an admin, or the SWARM_METRICS_TOKEN bearer token (for a Prometheus server)."""

    def __init__(self, leader):
        self.leader = leader

    async def get(self, request: Request) -> Response:
        try:
            await self._allowed(request)
        except AuthError as exc:  # Forbidden too
            return api_error(exc)
        return Response(self.leader.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    async def _allowed(self, request: Request) -> None:
        token = self.leader.settings.metrics_token
        given = bearer(request)
        if token and given and hmac.compare_digest(given.encode(), token.encode()):
            return
        user = await current_user(request, self.leader.store)
        if not user.is_admin:
            raise Forbidden("the metrics need an admin account, or the SWARM_METRICS_TOKEN set on the leader.")
