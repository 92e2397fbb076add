"""The task executor's Prometheus metrics: what GET /metrics serves (http_app.py).

One `ExecutorMetrics` per executor, on a `CollectorRegistry` of its own: several executors run in
one process (the tests, a fleet's actors), and the global default registry would mix their counts
and refuse the second executor's metric names.

Counters count since this process started (Prometheus handles resets). The gauges are read when
scraped, from the store and the callables given here, so they never go stale and include work
recovered after a restart. Metric names that predate this module are unchanged (dashboards use
them).

    dockyard_executor_queue_depth                        gauge      QUEUED tasks in the store
    dockyard_executor_running_tasks                      gauge      RUNNING tasks in the store
    dockyard_executor_tasks{status}                      gauge      tasks in the store, by status
    dockyard_executor_workers                            gauge      worker threads configured
    dockyard_executor_workers_alive                      gauge      worker threads alive
    dockyard_executor_tasks_completed_total{outcome}     counter    resolved|unresolved|infra_error
    dockyard_executor_verdicts_total{failure_kind}       counter    task.FailureKind; none=resolved
    dockyard_executor_task_retries_total                 counter    attempts retried (infra error)
    dockyard_executor_submissions_rejected_total{reason} counter    REJECTION_REASONS
    dockyard_executor_task_duration_seconds              histogram  final attempt of each task
    dockyard_executor_stage_duration_seconds{phase}      histogram  Verdict.timings_s of verdicts

With `image_stats` (the unpacked-image cache's figures, read at scrape time), also:

    dockyard_executor_image_cache_hits_total             counter
    dockyard_executor_image_cache_misses_total           counter
    dockyard_executor_image_cache_evictions_total        counter
    dockyard_executor_image_cache_bytes                  gauge      size of the cache now
    dockyard_executor_image_cache_images                 gauge      images in the cache now

Labels with a known set of values (outcome, failure_kind, reason) are exported at 0 from the
start, so a rate() over them has a series before the first event.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from dockyard_rl.sandbox.task import FailureKind, TaskStatus, Verdict

# Returns the image cache's figures: monotonic counts `hits`, `misses`, `evictions`; current
# `bytes` and `images`. Called at every scrape, from a worker thread of the HTTP server.
ImageStatsFn = Callable[[], Mapping[str, float]]

# The Content-Type header of `ExecutorMetrics.exposition()`'s body (the text format's version).
EXPOSITION_CONTENT_TYPE = CONTENT_TYPE_LATEST

OUTCOMES = ("resolved", "unresolved", "infra_error")
REJECTION_REASONS = ("unauthorized", "too_large", "invalid", "conflict", "queue_full")

_TASK_DURATION_BUCKETS_S = (
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1800.0,
    3600.0,
)
# Stages run from milliseconds (applying a patch) to the whole test timeout.
_STAGE_DURATION_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, *_TASK_DURATION_BUCKETS_S)


class ExecutorMetrics:
    """The metrics of one executor. The recording methods are safe to call from any thread."""

    def __init__(
        self,
        *,
        num_workers: int,
        counts: Callable[[], Mapping[TaskStatus, int]],
        num_workers_alive: Callable[[], int],
        image_stats: ImageStatsFn | None = None,
    ):
        """`counts` (tasks in the store by status) and `num_workers_alive` are called at each
        scrape, and so is `image_stats` when given."""
        self.registry = CollectorRegistry()
        self._completed = Counter(
            "dockyard_executor_tasks_completed_total",
            "Tasks that reached a final state since start, by outcome.",
            ["outcome"],
            registry=self.registry,
        )
        for outcome in OUTCOMES:
            self._completed.labels(outcome=outcome)
        self._verdicts = Counter(
            "dockyard_executor_verdicts_total",
            "Verdicts recorded since start, by failure kind (none: resolved).",
            ["failure_kind"],
            registry=self.registry,
        )
        for kind in FailureKind:
            self._verdicts.labels(failure_kind=kind.value)
        self._retries = Counter(
            "dockyard_executor_task_retries_total",
            "Scoring attempts retried after an infrastructure error.",
            registry=self.registry,
        )
        self._rejected = Counter(
            "dockyard_executor_submissions_rejected_total",
            "Submissions refused, by reason.",
            ["reason"],
            registry=self.registry,
        )
        for reason in REJECTION_REASONS:
            self._rejected.labels(reason=reason)
        self._task_duration = Histogram(
            "dockyard_executor_task_duration_seconds",
            "Wall-clock seconds of the final scoring attempt of each completed task.",
            buckets=_TASK_DURATION_BUCKETS_S,
            registry=self.registry,
        )
        self._stage_duration = Histogram(
            "dockyard_executor_stage_duration_seconds",
            "Seconds per scoring phase of each verdict (Verdict.timings_s).",
            ["phase"],
            buckets=_STAGE_DURATION_BUCKETS_S,
            registry=self.registry,
        )
        self.registry.register(
            _ScrapeTimeCollector(num_workers, counts, num_workers_alive, image_stats)
        )

    def verdict_recorded(self, verdict: Verdict, duration_s: float) -> None:
        """A task finished with `verdict`; its final attempt took `duration_s`."""
        self._completed.labels(outcome="resolved" if verdict.resolved else "unresolved").inc()
        self._verdicts.labels(failure_kind=verdict.failure_kind.value).inc()
        self._task_duration.observe(duration_s)
        for phase, seconds in verdict.timings_s.items():
            self._stage_duration.labels(phase=phase).observe(seconds)

    def infra_error_recorded(self, duration_s: float) -> None:
        """A task ended INFRA_ERROR; its final attempt took `duration_s`."""
        self._completed.labels(outcome="infra_error").inc()
        self._task_duration.observe(duration_s)

    def retried(self) -> None:
        self._retries.inc()

    def rejected(self, reason: str) -> None:
        assert reason in REJECTION_REASONS, reason
        self._rejected.labels(reason=reason).inc()

    def exposition(self) -> bytes:
        """The Prometheus text format, to serve as EXPOSITION_CONTENT_TYPE. Reads the store: call
        it off the event loop."""
        return generate_latest(self.registry)


class _ScrapeTimeCollector:
    """The figures owned elsewhere (the store, the worker threads, the image cache), read when
    Prometheus scrapes rather than copied into gauges that would go stale."""

    def __init__(
        self,
        num_workers: int,
        counts: Callable[[], Mapping[TaskStatus, int]],
        num_workers_alive: Callable[[], int],
        image_stats: ImageStatsFn | None,
    ):
        self._num_workers = num_workers
        self._counts = counts
        self._num_workers_alive = num_workers_alive
        self._image_stats = image_stats

    def collect(self) -> Iterator[Metric]:
        counts = self._counts()
        yield GaugeMetricFamily(
            "dockyard_executor_queue_depth",
            "Tasks accepted and waiting for a worker.",
            value=counts[TaskStatus.QUEUED],
        )
        yield GaugeMetricFamily(
            "dockyard_executor_running_tasks",
            "Tasks being scored now.",
            value=counts[TaskStatus.RUNNING],
        )
        by_status = GaugeMetricFamily(
            "dockyard_executor_tasks", "Tasks in the store, by status.", labels=["status"]
        )
        for status in TaskStatus:
            by_status.add_metric([status.value], counts[status])
        yield by_status
        yield GaugeMetricFamily(
            "dockyard_executor_workers", "Worker threads configured.", value=self._num_workers
        )
        yield GaugeMetricFamily(
            "dockyard_executor_workers_alive",
            "Worker threads alive.",
            value=self._num_workers_alive(),
        )
        if self._image_stats is None:
            return
        stats = self._image_stats()
        for key in ("hits", "misses", "evictions"):
            yield CounterMetricFamily(
                f"dockyard_executor_image_cache_{key}_total",
                f"Unpacked-image cache {key} since the cache started.",
                value=stats[key],
            )
        yield GaugeMetricFamily(
            "dockyard_executor_image_cache_bytes",
            "Bytes of unpacked images in the cache now.",
            value=stats["bytes"],
        )
        yield GaugeMetricFamily(
            "dockyard_executor_image_cache_images",
            "Images in the unpacked-image cache now.",
            value=stats["images"],
        )
