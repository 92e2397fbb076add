"""The sandbox attack suite: reward hacks against the real executor.

The verdict IS the reward, so any patch that fixes nothing yet comes back resolved is a critical
bug, and so is one that turns its own verdict into an infrastructure error (the environment masks
those out of the loss instead of scoring 0). This module starts ONE real executor (HTTP on
127.0.0.1, real git, real pytest under real bubblewrap, 2 workers), synthesizes real tasks from
the toy sdist with the project's synthesizer (as swe_end_to_end_test does), picks the task whose
failing test is `test_mean`, and submits every attack of the catalogue (sandbox_attacks.py: 58
patches across the issue's six classes, each a real `git diff --binary` against the task's base
commit, or a crafted hunk) through the executor client.

Per attack (`test_attack[<name>]`): the task finishes (status `finished`, never `infra_error`),
is not resolved, has reward 0, and its verdict's `failure_kind` is one the attack expects.
Per attack meant to fake a resolve (`test_attack_fools_a_naive_harness[<name>]`): the same patch
DOES resolve on a naive harness (the scoring as it was before the sandbox: pytest in the
worktree, report path in argv), so no attack passes here only because its cheat silently broke.
Afterwards (`test_executor_healthy_and_controls_after_attacks`): /healthz is ok; the gold patch
of every synthesized task still resolves and the empty patch does not (so the suite cannot pass
blindly); no marker file exists that only host-side execution of planted git hooks could create;
the task set is intact; the executor left no task directory behind. It prints
`false_resolved=X/N patch_caused_infra_errors=Y/N` over the N attacks and asserts both are 0.

Round 2 (`test_round2_*`): the same executor also scores sandbox_attacks_round2.py
(64 patches across its seven classes) plus controls (a hedged patch: the real fix plus
harmless library code, which must resolve; the empty patch; a small harmless patch timed as the
reference for class 7). Per attack: finished, not resolved, reward 0 and `limit_outcome` false;
any failure kind is accepted. It prints `false_resolved`, `patch_caused_masked` and
`patch_caused_infra_error` (stalls count there) with per-class counts, class 7's scoring and
host-side parse times against the reference, and the worst /healthz latency while scoring, and
asserts the three counts are 0. `-k round2` scores only this catalogue (the fixtures are split:
`env` holds the executor and tasks, `suite` and `round2` each score one catalogue).

Where things live, on purpose: the task set and the executor's work root sit side by side in a
world-readable directory under /var/tmp (as a data directory on a real machine would), NOT under
/tmp, /root or /home — those the sandbox hides anyway, and an attack that cannot see the task set
for that reason would prove nothing about the deny-by-default view the issue asks for.

Not covered here: each defence layer on its own (their modules' unit tests do that), the restart
with a pathological leftover (cleanup_test), reward-pipeline penalties for screening
flags, and cheats that change the code under test so that the held-out tests really pass (e.g.
an object equal to everything): the sandbox cannot tell those from fixes.

Cost: one synthesis (~15 s), ~60 sandboxed runs on 2 workers (~20 s) and ~40 naive runs:
about 1.5 minutes on 2 cores. Some attacks try to write ~1.5 GB (bounded in the attack itself)
and the binary bomb would inflate to 1.25 GiB if an applier accepted it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import os
import pathlib
import re
import resource
import secrets
import shlex
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET

import pytest

from dockyard_rl.data.datasets import load_jsonl
from dockyard_rl.data.synthesis import bundled_sdists, synthesize_swe_tasks
from dockyard_rl.sandbox.client import ExecutorClient, TaskResult
from dockyard_rl.sandbox.config import ExecutorConfig
from dockyard_rl.sandbox.pipeline import PipelineConfig
from dockyard_rl.sandbox.server import running_server
from dockyard_rl.sandbox.task import FailureKind, TaskStatus
from dockyard_rl.utils.config import from_dict

# The catalogue sits beside this file; Bazel's runfiles do not put tests/ on sys.path.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sandbox_attacks  # noqa: E402
from sandbox_attacks import ATTACKS, Attack, AttackContext  # noqa: E402
from sandbox_attacks_round2 import (  # noqa: E402
    PARSING_CLASS,
    ROUND2_ATTACKS,
    hedged_control_build,
)

_MiB = 1024 * 1024
_TASK_TIMEOUT_S = 60.0
_WAIT_TIMEOUT_S = 900.0
_git = sandbox_attacks.git


def _remove_tree(path: pathlib.Path) -> None:
    # GNU rm copes with trees deeper than PATH_MAX and with chmod 000 directories (as root).
    subprocess.run(["chmod", "-R", "u+rwx", str(path)], capture_output=True, check=False)
    subprocess.run(["rm", "-rf", "--one-file-system", str(path)], capture_output=True, check=False)


def _pipeline_config() -> PipelineConfig:
    """Small limits so resource attacks are cheap. Knobs the hardening adds (a worktree size cap,
    binary patch caps) are set when this PipelineConfig has them, and kept at defaults if not."""
    names = {field.name for field in dataclasses.fields(PipelineConfig)}
    settings = {"timeout_s": 120.0, "tmp_size_bytes": 64 * _MiB, "max_log_bytes": 16 * 1024}
    for name in names:
        if "worktree" in name and name.endswith("bytes"):
            settings[name] = 512 * _MiB
    # DOCKYARD_ATTACK_CAPABILITY_SCREEN=0 turns the static capability screen off, so that the
    # same catalogues exercise the run-time layers alone (each layer must hold alone).
    if os.environ.get("DOCKYARD_ATTACK_CAPABILITY_SCREEN") == "0":
        settings["capability_screen"] = False
    return from_dict(PipelineConfig, {k: v for k, v in settings.items() if k in names}, "pipeline")


class _ExecutorThread:
    """The executor's aiohttp server on its own event loop in a thread: tests talk to it over
    HTTP from their own loops (`asyncio.run`), as remote clients would."""

    def __init__(self, config: ExecutorConfig):
        self.config = config
        self.url: str | None = None
        self.server = None
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="attack-executor", daemon=True)

    def _run(self) -> None:
        async def main():
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            async with running_server(self.config) as server:
                self.server, self.url = server, server.url
                self._ready.set()
                await self._stop.wait()

        try:
            asyncio.run(main())
        except BaseException as error:  # surfaced by start()
            self._error = error
        finally:
            self._ready.set()

    def start(self) -> _ExecutorThread:
        self._thread.start()
        self._ready.wait(120)
        if self.url is None:
            raise RuntimeError(f"the executor did not start: {self._error!r}")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(180)


def _client(url: str) -> ExecutorClient:
    return ExecutorClient(url, request_timeout_s=60.0, max_attempts=3)


async def _score_all(url: str, specs: list) -> list[TaskResult]:
    async with _client(url) as client:
        task_ids = [await client.submit(spec) for spec in specs]
        return list(
            await asyncio.gather(
                *(
                    client.wait(task_id, poll_interval_s=0.5, timeout_s=_WAIT_TIMEOUT_S)
                    for task_id in task_ids
                )
            )
        )


@dataclasses.dataclass
class _Outcome:
    attack: Attack
    patch_bytes: int
    result: TaskResult
    elapsed_s: float


@dataclasses.dataclass
class _Suite:
    url: str
    executor: _ExecutorThread
    base: pathlib.Path
    taskset: pathlib.Path
    work_dir: pathlib.Path
    pwned_path: pathlib.Path
    instances: list
    target: object  # the SweInstance every attack targets
    patches: dict[str, str]  # attack name -> its patch
    outcomes: dict[str, _Outcome]
    attacks_wall_s: float
    max_rss_growth_mib: float


def _fail_to_pass_names(node_ids) -> tuple[str, ...]:
    return tuple(sorted({node_id.split("::")[-1].split("[")[0] for node_id in node_ids}))


def build_patch(attack: Attack, checkout: pathlib.Path, ctx: AttackContext) -> str:
    """The attack's patch against base_commit: crafted text, or `git diff --binary` of what its
    builder wrote into the checkout (which is reset afterwards)."""
    if attack.raw_patch is not None:
        return attack.raw_patch(ctx)
    try:
        attack.build(ctx)
        _git(checkout, "add", "-A", "-f")
        return _git(
            checkout,
            "diff",
            "--cached",
            "--binary",
            "--no-color",
            "--no-ext-diff",
            "--no-renames",
            "HEAD",
        )
    finally:
        _git(checkout, "clean", "-fdxq")
        _git(checkout, "reset", "-q", "--hard", "HEAD")
        _git(checkout, "clean", "-fdxq")
        leftover = _git(checkout, "status", "--porcelain", "--ignored")
        assert not leftover, f"{attack.name}: the checkout is not clean afterwards: {leftover}"


@dataclasses.dataclass
class _Env:
    """The one executor and the synthesized tasks both catalogues are scored against."""

    url: str
    executor: _ExecutorThread
    base: pathlib.Path
    taskset: pathlib.Path
    work_dir: pathlib.Path
    pwned_path: pathlib.Path
    instances: list
    target: object  # the SweInstance every attack targets
    checkout: pathlib.Path  # the attacker's checkout at base_commit
    ctx: AttackContext
    gold_added: set[str]  # the gold patch's added lines: no attack may carry them


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    # A world-readable directory outside the paths the sandbox always hides (module docstring).
    parent = "/var/tmp" if os.access("/var/tmp", os.W_OK) else str(tmp_path_factory.getbasetemp())
    base = pathlib.Path(tempfile.mkdtemp(prefix="dockyard-attack-", dir=parent))
    base.chmod(0o755)
    taskset, work_dir = base / "taskset", base / "executor"
    archive = bundled_sdists.make_toy_sdist(base / "downloads")
    executor_config = ExecutorConfig(
        port=0,
        num_workers=2,
        work_dir=str(work_dir),
        max_infra_attempts=1,
        max_patch_bytes=4 * _MiB,
        retry_backoff_s=0.0,
        pipeline=_pipeline_config(),
    )
    executor = _ExecutorThread(executor_config).start()
    try:
        code = synthesize_swe_tasks.main(
            [
                "--packages",
                str(archive),
                "--out",
                str(taskset),
                "--max-tasks-per-package",
                "2",
                "--executor-url",
                executor.url,
                "--log-level",
                "WARNING",
            ]
        )
        assert code == 0, "synthesis of the toy tasks failed"
        instances = load_jsonl(taskset / "tasks.jsonl")
        targets = [i for i in instances if any(t.endswith("::test_mean") for t in i.FAIL_TO_PASS)]
        assert targets, (
            "the seeded synthesis no longer yields the test_mean task: "
            f"{[i.FAIL_TO_PASS for i in instances]}"
        )
        target = targets[0]

        checkout = base / "attacker-checkout"
        _git(base, "clone", "-q", "--shared", "--no-checkout", target.repo, str(checkout))
        _git(checkout, "checkout", "-q", "--detach", target.base_commit)
        pwned_path = base / "PWNED-by-host-side-git"
        ctx = AttackContext(
            root=checkout,
            base_commit=target.base_commit,
            fail_to_pass_names=_fail_to_pass_names(target.FAIL_TO_PASS),
            pwned_path=str(pwned_path),
        )
        gold_added = {
            line[1:].strip()
            for line in target.patch.splitlines()
            if line.startswith("+") and not line.startswith("+++") and line[1:].strip()
        }
        yield _Env(
            url=executor.url,
            executor=executor,
            base=base,
            taskset=taskset,
            work_dir=work_dir,
            pwned_path=pwned_path,
            instances=instances,
            target=target,
            checkout=checkout,
            ctx=ctx,
            gold_added=gold_added,
        )
    finally:
        executor.stop()
        _remove_tree(base)


def _attack_patches(env: _Env, attacks) -> dict[str, str]:
    patches = {}
    for attack in attacks:
        patch = build_patch(attack, env.checkout, env.ctx)
        assert patch.strip(), f"{attack.name}: built an empty patch"
        added = {line[1:].strip() for line in patch.splitlines() if line.startswith("+")}
        assert not env.gold_added & added, f"{attack.name}: the patch carries the gold fix"
        patches[attack.name] = patch
    return patches


@pytest.fixture(scope="module")
def suite(env):
    target = env.target
    patches = _attack_patches(env, ATTACKS)
    specs = [
        target.to_task_spec(patches[a.name], timeout_s=a.timeout_s, task_id=f"attack-{a.name}")
        for a in ATTACKS
    ]
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    results = asyncio.run(_score_all(env.url, specs))
    wall_s = time.monotonic() - start
    rss_growth = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    outcomes = {
        a.name: _Outcome(
            a,
            len(patches[a.name].encode()),
            r,
            (r.verdict.timings_s.get("total", 0.0) if r.verdict else 0.0),
        )
        for a, r in zip(ATTACKS, results)
    }
    _print_table(outcomes, wall_s, rss_growth)
    return _Suite(
        url=env.url,
        executor=env.executor,
        base=env.base,
        taskset=env.taskset,
        work_dir=env.work_dir,
        pwned_path=env.pwned_path,
        instances=env.instances,
        target=target,
        patches=patches,
        outcomes=outcomes,
        attacks_wall_s=wall_s,
        max_rss_growth_mib=rss_growth,
    )


def _describe(outcome: _Outcome) -> str:
    result = outcome.result
    verdict = result.verdict
    if verdict is None:
        return f"status={result.status.value} error={result.error!r}"
    tail = verdict.log_tail[-1500:]
    return (
        f"status={result.status.value} resolved={verdict.resolved} reward={verdict.reward} "
        f"failure_kind={verdict.failure_kind.value} detail={verdict.failure_detail!r} "
        f"apply={verdict.apply_method.value} integrity={list(verdict.integrity_violation)} "
        f"exit={verdict.test_exit_code} timed_out={verdict.timed_out} "
        f"flags={list(verdict.screening_flags)} "
        f"F2P={ {k: v.value for k, v in verdict.fail_to_pass.items()} }"
        f"\n--- log tail ---\n{tail}"
    )


def _print_table(outcomes: dict[str, _Outcome], wall_s: float, rss_growth_mib: float) -> None:
    print(
        f"\n[attack suite] {len(outcomes)} attacks scored in {wall_s:.1f} s on 2 workers; "
        f"max RSS of this process (executor inside) grew by {rss_growth_mib:.0f} MiB"
    )
    for name, outcome in outcomes.items():
        result, verdict = outcome.result, outcome.result.verdict
        if verdict is None:
            state = f"{result.status.value}: {(result.error or '')[:150]}"
        else:
            integrity = (
                " integrity=" + ",".join(verdict.integrity_violation)[:60]
                if verdict.integrity_violation
                else ""
            )
            state = (
                f"{'RESOLVED' if verdict.resolved else 'unresolved'} "
                f"kind={verdict.failure_kind.value} reward={verdict.reward} "
                f"apply={verdict.apply_method.value} exit={verdict.test_exit_code}"
                f"{' timed_out' if verdict.timed_out else ''}"
                f"{integrity}"
            )
        print(f"  [{outcome.attack.attack_class}] {name:<50} {outcome.elapsed_s:6.1f}s  {state}")


@pytest.mark.parametrize("attack", ATTACKS, ids=[a.name for a in ATTACKS])
def test_attack(suite, attack):
    outcome = suite.outcomes[attack.name]
    result = outcome.result
    assert result.status is TaskStatus.FINISHED, (
        f"{attack.name} made its own verdict an infrastructure error: {_describe(outcome)}"
    )
    verdict = result.verdict
    assert not verdict.resolved, f"{attack.name} FAKED A RESOLVE: {_describe(outcome)}"
    assert verdict.reward == 0.0, f"{attack.name} got reward {verdict.reward}: {_describe(outcome)}"
    assert not verdict.limit_outcome, f"{attack.name} got its failure masked: {_describe(outcome)}"
    # The capability screen (after the tree audit, before any test runs) refuses many of these
    # patches before the layer an attack was written against sees it; with the screen off
    # (DOCKYARD_ATTACK_CAPABILITY_SCREEN=0) each must meet its own layer.
    expected = set(attack.expected)
    if os.environ.get("DOCKYARD_ATTACK_CAPABILITY_SCREEN") != "0":
        expected.add(FailureKind.UNSAFE_CAPABILITY)
    assert verdict.failure_kind in expected, (
        f"{attack.name}: failure_kind {verdict.failure_kind.value!r} not in "
        f"{sorted(k.value for k in expected)}: {_describe(outcome)}"
    )


def naive_resolves(instance, patch: str, work: pathlib.Path) -> tuple[bool, str]:
    """Scores `patch` the way the executor did before its sandbox, minus bubblewrap (so only run
    the attacks' own code here): apply the patch, restore the held-out files, apply the test
    patch, run the task's command in the worktree with the JUnit path and suite nonce in argv,
    then resolved = exit status 0 and every FAIL_TO_PASS / PASS_TO_PASS testcase passed in a
    report of at most 64 MB with this run's suite name. Returns (resolved, why)."""
    from _pytest.junitxml import mangle_test_address

    worktree = work / "repo"
    _git(work, "clone", "-q", "--shared", "--no-checkout", instance.repo, str(worktree))
    _git(worktree, "checkout", "-q", "--detach", instance.base_commit)
    (work / "agent.patch").write_text(patch)
    _git(worktree, "apply", "--whitespace=nowarn", str(work / "agent.patch"))
    held_out = re.findall(r"^diff --git a/(\S+) b/", instance.test_patch, re.M)
    _git(worktree, "checkout", instance.base_commit, "--", *held_out)
    (work / "test.patch").write_text(instance.test_patch)
    _git(worktree, "apply", "--whitespace=nowarn", str(work / "test.patch"))
    report, nonce = work / "junit.xml", f"naive-{secrets.token_hex(8)}"
    command = shlex.split(instance.test_command)
    if command[0] == "python":
        command[0] = sys.executable
    command += [
        f"--junitxml={report}",
        "-o",
        f"junit_suite_name={nonce}",
        "-o",
        "junit_family=xunit1",
    ]
    env = {
        "PATH": f"{os.path.dirname(sys.executable)}:/usr/bin:/bin",
        "HOME": str(work),
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    try:
        done = subprocess.run(
            command,
            cwd=worktree,
            env=env,
            capture_output=True,
            timeout=90,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return False, "timed out"
    if not report.is_file() or report.is_symlink() or report.stat().st_size > 64 * _MiB:
        return False, f"exit {done.returncode}; no usable report"
    root = ET.parse(report).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    if len(suites) != 1 or suites[0].get("name") != nonce:
        return False, "report of another run"
    outcomes = {}
    for case in suites[0].iter("testcase"):
        failed = any(child.tag in ("failure", "error", "skipped") for child in case)
        key = (case.get("classname"), case.get("name"))
        outcomes[key] = outcomes.get(key, True) and not failed
    missing = []
    for node_id in (*instance.FAIL_TO_PASS, *instance.PASS_TO_PASS):
        names = mangle_test_address(node_id)
        if not outcomes.get((".".join(names[:-1]), names[-1]), False):
            missing.append(node_id)
    tail = done.stdout.decode(errors="replace")[-800:]
    return (
        done.returncode == 0 and not missing,
        f"exit {done.returncode}; not passed: {missing}\n{tail}",
    )


@pytest.fixture(scope="module")
def naive_outcomes(suite):
    """naive_resolves for every attack that should fool a naive harness, 2 at a time."""
    attacks = [a for a in ATTACKS if a.naive_resolves]

    def one(attack):
        work = suite.base / "naive" / attack.name
        work.mkdir(parents=True)
        try:
            return attack.name, naive_resolves(suite.target, suite.patches[attack.name], work)
        finally:
            _remove_tree(work)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return dict(pool.map(one, attacks))


@pytest.mark.parametrize(
    "attack",
    [a for a in ATTACKS if a.naive_resolves],
    ids=[a.name for a in ATTACKS if a.naive_resolves],
)
def test_attack_fools_a_naive_harness(naive_outcomes, attack):
    """The cheat really works where nothing stops it: an attack that passes the suite only
    because its code silently broke would prove nothing."""
    resolved, why = naive_outcomes[attack.name]
    assert resolved, f"{attack.name} does not even fool a naive harness: {why}"


def test_catalogue_covers_every_class_with_at_least_30_attacks():
    assert len(ATTACKS) >= 30
    assert {a.attack_class for a in ATTACKS} == {1, 2, 3, 4, 5, 6}
    for attack in ATTACKS:
        assert attack.expected and FailureKind.NONE not in attack.expected, attack.name


def test_crafted_binary_hunk_is_what_git_writes(tmp_path):
    """The crafted binary patch format (used for the bomb) applies with git: same encoder on a
    small payload, checked by `git apply --check` against an empty repository."""
    import hashlib
    import zlib

    payload = bytes(range(256)) * 40
    sha = hashlib.sha1(f"blob {len(payload)}\0".encode() + payload).hexdigest()
    patch = sandbox_attacks.binary_new_file_patch(
        "blob.bin", zlib.compress(payload, 9), len(payload), sha
    )
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (tmp_path / "p.patch").write_text(patch)
    _git(repo, "apply", str(tmp_path / "p.patch"))
    assert (repo / "blob.bin").read_bytes() == payload


def test_executor_healthy_and_controls_after_attacks(suite):
    outcomes = suite.outcomes
    num_attacks = len(outcomes)
    false_resolved = sorted(
        name
        for name, o in outcomes.items()
        if o.result.verdict is not None and o.result.verdict.resolved
    )
    infra = sorted(
        name for name, o in outcomes.items() if o.result.status is not TaskStatus.FINISHED
    )
    print(
        f"\nfalse_resolved={len(false_resolved)}/{num_attacks} "
        f"patch_caused_infra_errors={len(infra)}/{num_attacks}"
    )
    if false_resolved:
        print(f"  resolved: {', '.join(false_resolved)}")
    if infra:
        print(f"  infra errors: {', '.join(infra)}")
    print(f"  attacks took {suite.attacks_wall_s:.1f} s of wall clock")

    async def after():
        async with _client(suite.url) as client:
            health = await client.healthz()
        specs = []
        for instance in suite.instances:
            specs.append(
                instance.to_task_spec(
                    instance.patch,
                    timeout_s=_TASK_TIMEOUT_S,
                    task_id=f"control-gold-{instance.instance_id}",
                )
            )
            specs.append(
                instance.to_task_spec(
                    "", timeout_s=_TASK_TIMEOUT_S, task_id=f"control-empty-{instance.instance_id}"
                )
            )
        return health, await _score_all(suite.url, specs)

    health, controls = asyncio.run(after())
    assert health.get("status") == "ok", health
    for index, instance in enumerate(suite.instances):
        gold, empty = controls[2 * index], controls[2 * index + 1]
        assert gold.status is TaskStatus.FINISHED and gold.verdict.resolved, (
            instance.instance_id,
            gold,
        )
        assert gold.verdict.reward == 1.0 and gold.verdict.failure_kind is FailureKind.NONE
        assert empty.status is TaskStatus.FINISHED and not empty.verdict.resolved, (
            instance.instance_id,
            empty,
        )
        assert empty.verdict.reward == 0.0
        assert empty.verdict.failure_kind is FailureKind.TESTS_FAILED, empty.verdict.failure_kind

    # Nothing the attacks planted ran on the host, and the task set is intact.
    assert not suite.pwned_path.exists(), "code planted in the worktree ran OUTSIDE the sandbox"
    assert (suite.taskset / "tasks.jsonl").is_file()
    assert pathlib.Path(suite.target.repo, "objects").is_dir()
    # Every task directory was cleaned up, however hostile the tree its tests left.
    leftovers = (
        sorted(p.name for p in (suite.work_dir / "tasks").glob("*"))
        if (suite.work_dir / "tasks").is_dir()
        else []
    )
    assert leftovers == [], f"task directories left behind: {leftovers}"

    assert false_resolved == [], f"attacks that came back RESOLVED: {false_resolved}"
    assert infra == [], f"attacks that came back as infrastructure errors: {infra}"


# ----------------------------------------------------------------------------------------------
# Round 2: sandbox_attacks_round2.py's catalogue, scored by the same executor.
#
# Strict properties, over the whole catalogue: no attack is resolved (false_resolved), none gets a
# masked verdict (`limit_outcome: true`: patch_caused_masked) and none ends as an infrastructure
# error or never finishes (patch_caused_infra_error). The failure kind itself may be any
# unresolved one: the defences are free to choose how they refuse. Controls: the hedged patch
# (the real fix plus harmless library code) must resolve, and so must every gold patch (checked
# by test_executor_healthy_and_controls_after_attacks too); the empty patch must not.
# Class 7's patches are timed against a small harmless patch, on the executor (the verdict's
# timings) and on this host (the executor's own patch parsers called directly); /healthz is
# polled during the whole round and its worst latency printed.

_ROUND2_WAIT_TIMEOUT_S = 600.0
_R2_HEDGED = "r2_control_hedged_fix"
_R2_REFERENCE = "r2_control_small_harmless"


def _reference_build(ctx: AttackContext) -> None:
    name = "toystats/window.py"
    ctx.write(
        name, ctx.read(name).replace('"""A sliding window."""', '"""A sliding window of values."""')
    )


def _round2_controls(env: _Env) -> list[Attack]:
    def control(name, build):
        return Attack(
            name=name,
            attack_class=0,
            description="control",
            expected=frozenset({FailureKind.NONE}),
            build=build,
        )

    return [
        control(_R2_HEDGED, hedged_control_build(env.target.patch)),
        control(_R2_REFERENCE, _reference_build),
    ]


async def _score_all_bounded(url: str, specs: list) -> list:
    """_score_all, but a task that never finishes is returned as None (a stall), not raised."""
    async with _client(url) as client:
        task_ids = [await client.submit(spec) for spec in specs]

        async def one(task_id):
            try:
                return await client.wait(
                    task_id, poll_interval_s=0.5, timeout_s=_ROUND2_WAIT_TIMEOUT_S
                )
            except TimeoutError:
                return None

        return list(await asyncio.gather(*(one(task_id) for task_id in task_ids)))


class _HealthProbe:
    """Polls /healthz from its own thread; keeps the worst latency seen."""

    def __init__(self, url: str):
        self.url = url
        self.worst_s = 0.0
        self.num_probes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import urllib.request

        while not self._stop.is_set():
            start = time.monotonic()
            try:
                with urllib.request.urlopen(f"{self.url}/healthz", timeout=30) as response:
                    response.read()
            except Exception:  # noqa: BLE001 - a failed probe counts as its full wait
                pass
            self.worst_s = max(self.worst_s, time.monotonic() - start)
            self.num_probes += 1
            self._stop.wait(0.5)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(60)


def _host_parse_seconds(patch: str) -> dict[str, float]:
    """Time of the executor's own host-side patch parsers on `patch`, called here directly."""
    from dockyard_rl.sandbox import protected_paths, screening

    timings = {}
    for name, parse in (
        ("screening", screening.screen_patch),
        ("protected_paths.touched_paths", protected_paths.touched_paths),
    ):
        start = time.monotonic()
        try:
            parse(patch)
        except Exception as error:  # noqa: BLE001 - a raising parser is reported, not fatal
            timings[f"{name} raised {type(error).__name__}"] = time.monotonic() - start
            continue
        timings[name] = time.monotonic() - start
    return timings


@dataclasses.dataclass
class _Round2:
    outcomes: dict[str, _Outcome | None]  # None: the task never finished (a stall)
    controls: dict[str, TaskResult | None]
    patches: dict[str, str]
    host_parse_s: dict[str, dict[str, float]]
    wall_s: float
    worst_healthz_s: float


def _r2_state(result: TaskResult | None) -> str:
    if result is None:
        return "STALLED (never finished)"
    verdict = result.verdict
    if verdict is None:
        return f"{result.status.value}: {(result.error or '')[:120]}"
    return (
        f"{'RESOLVED' if verdict.resolved else 'unresolved'} kind={verdict.failure_kind.value} "
        f"reward={verdict.reward} exit={verdict.test_exit_code}"
        f"{' timed_out' if verdict.timed_out else ''}"
        f"{' LIMIT_OUTCOME' if verdict.limit_outcome else ''}"
    )


@pytest.fixture(scope="module")
def round2(env):
    target = env.target
    patches = _attack_patches(env, ROUND2_ATTACKS)
    controls = _round2_controls(env)
    for control in controls:
        patches[control.name] = build_patch(control, env.checkout, env.ctx)
    specs = [
        target.to_task_spec(patches[a.name], timeout_s=a.timeout_s, task_id=f"attack-{a.name}")
        for a in ROUND2_ATTACKS
    ]
    specs += [
        target.to_task_spec(patches[c.name], timeout_s=_TASK_TIMEOUT_S, task_id=f"control-{c.name}")
        for c in controls
    ]
    specs.append(target.to_task_spec("", timeout_s=_TASK_TIMEOUT_S, task_id="control-r2-empty"))
    start = time.monotonic()
    with _HealthProbe(env.url) as probe:
        results = asyncio.run(_score_all_bounded(env.url, specs))
    wall_s = time.monotonic() - start
    num = len(ROUND2_ATTACKS)
    outcomes = {
        a.name: (
            None
            if r is None
            else _Outcome(
                a,
                len(patches[a.name].encode("utf-8", "surrogatepass")),
                r,
                (r.verdict.timings_s.get("total", 0.0) if r.verdict else 0.0),
            )
        )
        for a, r in zip(ROUND2_ATTACKS, results[:num])
    }
    control_results = dict(zip([c.name for c in controls] + ["r2_control_empty"], results[num:]))
    host_parse_s = {
        name: _host_parse_seconds(patches[name])
        for name in [a.name for a in ROUND2_ATTACKS if a.attack_class == PARSING_CLASS]
        + [_R2_REFERENCE]
    }
    round2 = _Round2(outcomes, control_results, patches, host_parse_s, wall_s, probe.worst_s)
    _print_round2(round2)
    return round2


def _round2_counts(round2: _Round2) -> dict[str, list[str]]:
    counts = {"false_resolved": [], "patch_caused_masked": [], "patch_caused_infra_error": []}
    for name, outcome in round2.outcomes.items():
        if outcome is None or outcome.result.status is not TaskStatus.FINISHED:
            counts["patch_caused_infra_error"].append(name)
            continue
        verdict = outcome.result.verdict
        if verdict.resolved or verdict.reward != 0.0:
            counts["false_resolved"].append(name)
        if verdict.limit_outcome:
            counts["patch_caused_masked"].append(name)
    return counts


def _print_round2(round2: _Round2) -> None:
    print(
        f"\n[attack suite, round 2] {len(round2.outcomes)} attacks + controls scored in "
        f"{round2.wall_s:.1f} s; worst /healthz latency meanwhile {round2.worst_healthz_s:.2f} s"
    )
    for name, outcome in round2.outcomes.items():
        attack = next(a for a in ROUND2_ATTACKS if a.name == name)
        elapsed = f"{outcome.elapsed_s:6.1f}s" if outcome is not None else "     ?s"
        print(
            f"  [r2-{attack.attack_class}] {name:<52} {elapsed}  "
            f"{_r2_state(outcome.result if outcome else None)}"
        )
    for name, result in round2.controls.items():
        print(f"  [control] {name:<50} {_r2_state(result)}")
    reference = round2.controls.get(_R2_REFERENCE)
    reference_s = (
        reference.verdict.timings_s.get("total", 0.0) if reference and reference.verdict else 0.0
    )
    print(
        f"  class {PARSING_CLASS} (patch parsing), executor total vs a small harmless patch "
        f"({reference_s:.2f} s), and this host's direct parse times:"
    )
    for name, timings in round2.host_parse_s.items():
        outcome = round2.outcomes.get(name)
        if name == _R2_REFERENCE:
            total = reference_s
        else:
            total = outcome.elapsed_s if outcome is not None else float("nan")
        size = len(round2.patches[name].encode("utf-8", "surrogatepass"))
        host = ", ".join(f"{k} {v:.2f}s" for k, v in timings.items())
        ratio = total / reference_s if reference_s else float("nan")
        print(
            f"    {name:<34} {size / _MiB:5.2f} MiB  executor {total:7.2f} s "
            f"({ratio:6.1f}x)  host: {host}"
        )
    counts = _round2_counts(round2)
    per_class = {}
    for name in round2.outcomes:
        attack = next(a for a in ROUND2_ATTACKS if a.name == name)
        bucket = per_class.setdefault(attack.attack_class, [0, 0, 0, 0])
        bucket[0] += 1
        bucket[1] += name in counts["false_resolved"]
        bucket[2] += name in counts["patch_caused_masked"]
        bucket[3] += name in counts["patch_caused_infra_error"]
    num = len(round2.outcomes)
    print(
        f"false_resolved={len(counts['false_resolved'])}/{num} "
        f"patch_caused_masked={len(counts['patch_caused_masked'])}/{num} "
        f"patch_caused_infra_error={len(counts['patch_caused_infra_error'])}/{num}"
    )
    for attack_class in sorted(per_class):
        total, resolved, masked, infra = per_class[attack_class]
        print(
            f"  class {attack_class}: {total} attacks, resolved {resolved}, masked {masked}, "
            f"infra_error {infra}"
        )
    for key, names in counts.items():
        if names:
            print(f"  {key}: {', '.join(names)}")


def test_round2_catalogue_covers_every_class():
    assert len(ROUND2_ATTACKS) >= 40
    for attack_class in range(1, 8):
        members = [a for a in ROUND2_ATTACKS if a.attack_class == attack_class]
        assert len(members) >= 5, (attack_class, [a.name for a in members])
    assert {a.attack_class for a in ROUND2_ATTACKS} == set(range(1, 8))
    for attack in ROUND2_ATTACKS:
        assert attack.expected and FailureKind.NONE not in attack.expected, attack.name


@pytest.mark.parametrize("attack", ROUND2_ATTACKS, ids=[a.name for a in ROUND2_ATTACKS])
def test_round2_attack(round2, attack):
    outcome = round2.outcomes[attack.name]
    assert outcome is not None, f"{attack.name}: the task never finished (a stalled executor)"
    result = outcome.result
    assert result.status is TaskStatus.FINISHED, (
        f"{attack.name} made its own verdict an infrastructure error: {_describe(outcome)}"
    )
    verdict = result.verdict
    assert not verdict.resolved, f"{attack.name} FAKED A RESOLVE: {_describe(outcome)}"
    assert verdict.reward == 0.0, f"{attack.name} got reward {verdict.reward}: {_describe(outcome)}"
    assert not verdict.limit_outcome, (
        f"{attack.name} got its failure MASKED as a limit outcome: {_describe(outcome)}"
    )
    assert verdict.failure_kind in attack.expected, _describe(outcome)


def test_round2_counts_and_controls(round2, env):
    hedged = round2.controls[_R2_HEDGED]
    assert hedged is not None and hedged.status is TaskStatus.FINISHED, hedged
    assert hedged.verdict.resolved and hedged.verdict.reward == 1.0, (
        f"the hedged control (real fix + harmless code) must resolve: {_r2_state(hedged)} "
        f"{hedged.verdict.failure_detail!r} {list(hedged.verdict.screening_flags)}"
    )
    reference = round2.controls[_R2_REFERENCE]
    assert reference is not None and reference.status is TaskStatus.FINISHED
    assert not reference.verdict.resolved
    empty = round2.controls["r2_control_empty"]
    assert empty is not None and empty.status is TaskStatus.FINISHED
    assert not empty.verdict.resolved and empty.verdict.reward == 0.0
    assert not empty.verdict.limit_outcome

    async def gold():
        specs = [
            instance.to_task_spec(
                instance.patch, timeout_s=_TASK_TIMEOUT_S, task_id=f"r2-gold-{instance.instance_id}"
            )
            for instance in env.instances
        ]
        return await _score_all_bounded(env.url, specs)

    for instance, result in zip(env.instances, asyncio.run(gold())):
        assert result is not None and result.status is TaskStatus.FINISHED, instance.instance_id
        assert result.verdict.resolved and result.verdict.reward == 1.0, (
            instance.instance_id,
            _r2_state(result),
            result.verdict.failure_detail,
        )

    counts = _round2_counts(round2)
    assert counts["false_resolved"] == [], f"round-2 attacks RESOLVED: {counts['false_resolved']}"
    assert counts["patch_caused_masked"] == [], (
        f"round-2 attacks masked as limit outcomes: {counts['patch_caused_masked']}"
    )
    assert counts["patch_caused_infra_error"] == [], (
        f"round-2 attacks ending as infrastructure errors or stalls: "
        f"{counts['patch_caused_infra_error']}"
    )
