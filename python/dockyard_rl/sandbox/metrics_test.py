"""Tests of the executor's Prometheus metrics, scraped over real HTTP on 127.0.0.1 and parsed with
prometheus_client: counts by outcome, failure kind and reason, the duration histograms, the gauges
read at scrape time, and the image cache's figures. The scoring function is injected.
"""

import asyncio
import dataclasses
import threading

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dockyard_rl.sandbox import pipeline
from dockyard_rl.sandbox.task import FailureKind, TaskStatus
from dockyard_rl.sandbox.testing_executor import (
    GOLD,
    body,
    make_config,
    serve_and,
    verdict_for,
    wait_done,
)


def test_healthz_and_metrics_parse(tmp_path):
    def flaky_once_score(spec, work_root):
        if spec.task_id == "flaky" and not (tmp_path / "flaked").exists():
            (tmp_path / "flaked").touch()
            raise pipeline.InfrastructureError("mirror fetch failed")
        if spec.task_id == "broken":
            raise pipeline.InfrastructureError("disk full")
        return verdict_for(spec)

    config = make_config(tmp_path, max_infra_attempts=2)

    async def scenario(http, server):
        async with http.get(f"{server.url}/healthz") as response:
            health = (response.status, await response.json())
        for task_id, patch in (("good", GOLD), ("bad", ""), ("flaky", GOLD), ("broken", GOLD)):
            async with http.post(
                f"{server.url}/task/submit", json=body(task_id, patch=patch)
            ) as response:
                assert response.status == 202
        async with http.post(f"{server.url}/task/submit", data=b"{") as response:
            assert response.status == 400
        for task_id in ("good", "bad", "flaky", "broken"):
            await wait_done(http, server.url, task_id)
        return health, await scrape(http, server.url)

    health, (families, samples) = serve_and(config, flaky_once_score, scenario)
    assert health == (
        200,
        {"status": "ok", "workers": 2, "workers_alive": 2, "queue_depth": 0, "running": 0},
    )
    assert families["dockyard_executor_task_duration_seconds"].type == "histogram"
    assert samples[("dockyard_executor_queue_depth", ())] == 0
    assert samples[("dockyard_executor_running_tasks", ())] == 0
    completed = "dockyard_executor_tasks_completed_total"
    assert samples[(completed, (("outcome", "resolved"),))] == 2  # good, flaky
    assert samples[(completed, (("outcome", "unresolved"),))] == 1  # bad
    assert samples[(completed, (("outcome", "infra_error"),))] == 1  # broken
    assert samples[("dockyard_executor_task_retries_total", ())] == 2  # flaky once, broken once
    rejected = "dockyard_executor_submissions_rejected_total"
    assert samples[(rejected, (("reason", "invalid"),))] == 1
    assert samples[(rejected, (("reason", "queue_full"),))] == 0  # every reason, from 0
    assert samples[("dockyard_executor_task_duration_seconds_count", ())] == 4
    assert samples[("dockyard_executor_task_duration_seconds_bucket", (("le", "+Inf"),))] == 4
    assert samples[("dockyard_executor_workers", ())] == 2
    assert samples[("dockyard_executor_workers_alive", ())] == 2
    # No image_stats given: no image cache metrics.
    assert not [name for name in families if "image_cache" in name]


async def scrape(http, url):
    """GET /metrics parsed: ({family name: family}, {(sample name, sorted labels): value})."""
    async with http.get(f"{url}/metrics") as response:
        assert response.status == 200
        assert response.headers["Content-Type"] == prometheus_client.CONTENT_TYPE_LATEST
        text = await response.text()
    families = {family.name: family for family in text_string_to_metric_families(text)}
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in families.values()
        for sample in family.samples
    }
    return families, samples


def test_metrics_by_outcome_failure_kind_stage_and_image_cache(tmp_path):
    release = threading.Event()
    phases = {"checkout": 0.2, "apply": 0.02, "tests": 3.0, "total": 3.3}

    def scorer(spec, work_root):
        if spec.task_id == "infra":
            raise pipeline.InfrastructureError("bwrap failed to start")
        if spec.task_id == "blocker":
            assert release.wait(timeout=30)
        verdict = dataclasses.replace(verdict_for(spec), timings_s=dict(phases))
        if not verdict.resolved:
            verdict = dataclasses.replace(
                verdict,
                failure_kind=FailureKind.TESTS_FAILED,
                failure_detail="tests/t.py::test_new failed",
            )
        return verdict

    # Changed between scrapes: the figures must be read at scrape time.
    image_figures = {"hits": 5, "misses": 2, "evictions": 1, "bytes": 3 << 30, "images": 2}
    config = make_config(tmp_path, num_workers=1, max_infra_attempts=1)

    async def scenario(http, server):
        async def submit(task_id, patch=GOLD):
            async with http.post(
                f"{server.url}/task/submit", json=body(task_id, patch=patch)
            ) as response:
                assert response.status == 202

        # The one worker holds "blocker" while "waiting" stays in the queue.
        await submit("blocker")
        while server.executor.counts()[TaskStatus.RUNNING] != 1:
            await asyncio.sleep(0.01)
        await submit("waiting")
        busy = await scrape(http, server.url)
        release.set()
        await submit("unresolved", patch="")
        await submit("infra")
        for task_id in ("blocker", "waiting", "unresolved", "infra"):
            await wait_done(http, server.url, task_id)
        image_figures.update(hits=9, bytes=1 << 30, images=1)
        return busy, await scrape(http, server.url)

    (_, busy), (families, samples) = serve_and(
        config, scorer, scenario, image_stats=lambda: dict(image_figures)
    )
    assert busy[("dockyard_executor_queue_depth", ())] == 1
    assert busy[("dockyard_executor_running_tasks", ())] == 1
    assert busy[("dockyard_executor_tasks", (("status", "queued"),))] == 1
    assert busy[("dockyard_executor_tasks", (("status", "running"),))] == 1
    assert busy[("dockyard_executor_image_cache_hits_total", ())] == 5

    assert samples[("dockyard_executor_queue_depth", ())] == 0
    assert samples[("dockyard_executor_running_tasks", ())] == 0
    assert samples[("dockyard_executor_tasks", (("status", "finished"),))] == 3
    assert samples[("dockyard_executor_tasks", (("status", "infra_error"),))] == 1
    completed = "dockyard_executor_tasks_completed_total"
    assert samples[(completed, (("outcome", "resolved"),))] == 2  # blocker, waiting
    assert samples[(completed, (("outcome", "unresolved"),))] == 1
    assert samples[(completed, (("outcome", "infra_error"),))] == 1
    verdicts = "dockyard_executor_verdicts_total"
    assert samples[(verdicts, (("failure_kind", "none"),))] == 2
    assert samples[(verdicts, (("failure_kind", "tests_failed"),))] == 1
    assert samples[(verdicts, (("failure_kind", "timeout"),))] == 0  # every kind, from 0
    assert samples[("dockyard_executor_task_duration_seconds_count", ())] == 4
    # One observation per phase of each of the three verdicts (an infra error has none).
    assert families["dockyard_executor_stage_duration_seconds"].type == "histogram"
    for phase, seconds in phases.items():
        labels = (("phase", phase),)
        assert samples[("dockyard_executor_stage_duration_seconds_count", labels)] == 3
        assert samples[("dockyard_executor_stage_duration_seconds_sum", labels)] == pytest.approx(
            3 * seconds
        )
    assert (
        samples[
            (
                "dockyard_executor_stage_duration_seconds_bucket",
                (("le", "0.25"), ("phase", "checkout")),
            )
        ]
        == 3
    )
    assert (
        samples[
            ("dockyard_executor_stage_duration_seconds_bucket", (("le", "2.5"), ("phase", "tests")))
        ]
        == 0
    )
    assert families["dockyard_executor_image_cache_hits"].type == "counter"
    assert families["dockyard_executor_image_cache_bytes"].type == "gauge"
    assert samples[("dockyard_executor_image_cache_hits_total", ())] == 9
    assert samples[("dockyard_executor_image_cache_misses_total", ())] == 2
    assert samples[("dockyard_executor_image_cache_evictions_total", ())] == 1
    assert samples[("dockyard_executor_image_cache_bytes", ())] == 1 << 30
    assert samples[("dockyard_executor_image_cache_images", ())] == 1
