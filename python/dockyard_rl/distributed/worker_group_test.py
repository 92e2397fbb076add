"""WorkerGroup on a simulated cluster on 127.0.0.1 (one per module: two trainer nodes and an
inference node): ranks and a real gloo rendezvous, SPREAD / PACK placement, fail-fast calls,
restarts after ray.kill and os._exit, the restart limit, start-up failures, shutdown."""

import os
import time

import pytest
import ray

from dockyard_rl.cluster.bootstrap import PlacementTimeoutError
from dockyard_rl.cluster.testing_cluster import fleet_cluster
from dockyard_rl.distributed.worker_group import (
    WorkerDiedError,
    WorkerError,
    WorkerGroup,
    WorkerRestartError,
    current_worker,
)


@pytest.fixture(scope="module")
def cluster():
    with fleet_cluster([("trainer", 1), ("trainer", 1), ("inference", 2)]) as fleet:
        fleet.connect(placement_timeout_s=30, fleets={"trainer": {"nccl_env": {"debug": "WARN"}}})
        yield fleet


@ray.remote(num_cpus=1)
def _node_of_task() -> str:
    return ray.get_runtime_context().get_node_id()


def _kill_and_wait(actor, timeout_s: float = 30.0) -> None:
    """ray.kill only asks for the kill: a call sent right after it may still reach the live
    process (seen in CI: a health check passed and nothing was restarted). Returns once the
    actor is gone."""
    ray.kill(actor)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=timeout_s)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.05)
    raise AssertionError(f"the actor is still alive {timeout_s:g} s after ray.kill")


class Worker:
    def __init__(self, tag: str, fail_rank: int | None = None):
        if current_worker().rank == fail_rank:
            raise ValueError(f"rank {fail_rank} cannot start")
        self.tag, self.calls = tag, 0

    def whoami(self) -> dict:
        return {
            "info": current_worker(),
            "tag": self.tag,
            "calls": self.calls,
            "pid": os.getpid(),
            "nccl_debug": os.environ.get("NCCL_DEBUG"),
        }

    def bump(self) -> int:
        self.calls += 1
        return self.calls

    def all_reduce(self, value: float) -> float:
        # torch's env:// rendezvous from what the group put in the environment.
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        try:
            tensor = torch.tensor([value])
            dist.all_reduce(tensor)
            return tensor.item()
        finally:
            dist.destroy_process_group()

    def fail_on(self, rank: int) -> str:
        if current_worker().rank == rank:
            raise ValueError(f"rank {rank} refuses")
        time.sleep(30)
        return "slept"

    def exit(self) -> None:
        os._exit(3)

    def child_nodes(self, count: int) -> list[str]:
        # Tasks a worker starts land in its own placement group (capture_child_tasks).
        return ray.get([_node_of_task.remote() for _ in range(count)])


def _group(cluster, num_workers=2, role="trainer", **kwargs) -> WorkerGroup:
    kwargs.setdefault("worker_args", lambda info: (("t",), {}))
    return WorkerGroup(
        Worker,
        num_workers,
        role,
        cluster.config(placement_timeout_s=30, fleets={"trainer": {"nccl_env": {"debug": "WARN"}}}),
        **kwargs,
    )


def test_ranks_know_their_place_spread_over_trainer_nodes_and_rendezvous(cluster):
    with _group(cluster, worker_args=lambda info: ((f"t{info.rank}",), {})) as group:
        whoami = group.call_all("whoami")
        infos = [w["info"] for w in whoami]
        assert [i.rank for i in infos] == [0, 1] and {i.world_size for i in infos} == {2}
        assert infos == group.worker_infos
        assert [w["tag"] for w in whoami] == ["t0", "t1"]  # per-rank constructor args
        # SPREAD: one rank per trainer node.
        assert sorted(i.node_id for i in infos) == sorted(cluster.nodes["trainer"])
        assert {(i.local_rank, i.local_world_size) for i in infos} == {(0, 1)}
        assert {(i.master_addr, i.master_port) for i in infos} == {group.master_address}
        assert group.master_address[0] == "127.0.0.1"
        assert {w["nccl_debug"] for w in whoami} == {"WARN"}  # the fleet's NCCL settings
        assert group.call_all("all_reduce", per_rank_args=[(1.0,), (2.0,)]) == [3.0, 3.0]


def test_calls_fail_fast_naming_the_rank(cluster):
    with _group(cluster, max_concurrency=2) as group:
        started = time.monotonic()
        with pytest.raises(WorkerError) as error:
            group.call_all("fail_on", 1)
        assert time.monotonic() - started < 15  # rank 0 sleeps 30 s: not waited for
        assert not isinstance(error.value, WorkerDiedError)
        assert error.value.rank == 1 and error.value.method == "fail_on"
        assert "fail_on failed on rank 1: ValueError: rank 1 refuses" in str(error.value)
        assert group.call_all("bump") == [1, 1]  # the group stays usable
        assert group.call_rank(1, "bump") == 2
        with pytest.raises(WorkerError, match=r"rank\(s\) \[0\] gave no answer within 1 s"):
            group.call_rank(0, "fail_on", 1, timeout_s=1)


def test_a_dead_worker_is_restarted_and_the_group_recovers(cluster):
    restarted = []

    def on_restart(group, ranks):  # the caller's re-setup: here, state every rank must have
        restarted.append(ranks)
        group.call_all("bump")

    with _group(cluster, on_restart=on_restart, max_restarts=2) as group:
        assert group.call_all("bump") == [1, 1]
        before = group.call_all("whoami")

        _kill_and_wait(group.actors[1])
        with pytest.raises(WorkerDiedError, match="rank 1 died during bump") as error:
            group.call_all("bump")
        assert error.value.rank == 1
        assert group.restart_dead_workers() == [1] and restarted == [[1]]
        after = group.call_all("whoami")
        # Rank 1 is a new process built from the same args; rank 0 kept its state.
        assert after[1]["pid"] != before[1]["pid"] and after[1]["tag"] == "t"
        assert [w["calls"] for w in after] == [3, 1]
        assert group.restart_counts == [0, 1]

        # A worker that exits by itself; found by the health check this time.
        with pytest.raises(WorkerDiedError, match="rank 0 died during exit"):
            group.call_rank(0, "exit")
        assert 0 in group.health_check(timeout_s=30)
        assert group.restart_dead_workers() == [0] and restarted == [[1], [0]]
        assert group.health_check() == {}
        infos = [w["info"] for w in group.call_all("whoami")]
        # The restarted rank 0 knows the (possibly new) master; the group reports it.
        assert (infos[0].master_addr, infos[0].master_port) == group.master_address
        assert group.restart_dead_workers() == []


def test_restarts_beyond_the_limit_are_a_clear_error(cluster):
    with _group(cluster, num_workers=1, max_restarts=1) as group:
        _kill_and_wait(group.actors[0])
        assert group.restart_dead_workers(timeout_s=30) == [0]
        _kill_and_wait(group.actors[0])
        with pytest.raises(WorkerRestartError) as error:
            group.restart_dead_workers(timeout_s=30)
        message = str(error.value)
        assert error.value.rank == 0
        assert "trainer worker group: rank 0 is dead and was restarted 1 time(s) already" in message
        assert "max_restarts=1, cluster.fleets.trainer.max_worker_restarts" in message
        assert "last cause: ActorDiedError" in message


def test_an_engine_with_several_bundles_is_packed_with_its_children(cluster):
    # One worker per engine, its tensor-parallel ranks as child tasks in its own group (PACK).
    with _group(cluster, num_workers=1, role="inference", bundles_per_worker=2) as group:
        [info] = group.worker_infos
        assert [info.node_id] == cluster.nodes["inference"]
        assert group.call_rank(0, "child_nodes", 2) == cluster.nodes["inference"] * 2


def test_a_worker_that_cannot_start_is_named_and_nothing_is_left(cluster):
    with pytest.raises(WorkerError) as error:
        _group(cluster, worker_args=lambda info: (("t",), {"fail_rank": 1}))
    assert error.value.rank == 1 and error.value.method == "__init__"
    assert "rank 1 cannot start" in str(error.value)
    with pytest.raises(PlacementTimeoutError, match="trainer fleet cannot be placed"):
        WorkerGroup(Worker, 3, "trainer", cluster.config(placement_timeout_s=2))
    # Both failures released their bundles: the two trainer CPUs are free again.
    with _group(cluster) as group:
        assert group.call_all("bump") == [1, 1]


def test_shutdown_is_idempotent_and_final(cluster):
    group = _group(cluster, num_workers=1)
    group.shutdown(method="bump")
    group.shutdown()
    with pytest.raises(RuntimeError, match="trainer worker group was shut down"):
        group.call_all("bump")
    with (
        _group(cluster) as group,
        pytest.raises(ValueError, match="per_rank_args: 1 entries for 2 ranks"),
    ):
        group.submit_all("bump", per_rank_args=[()])
