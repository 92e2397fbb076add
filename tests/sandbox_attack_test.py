"""The sandbox attack suite (issue 12, "Tests"): reward hacks against the real executor.

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
DOES resolve on a naive harness (the pre-issue-12 scoring without its sandbox: pytest in the
worktree, report path in argv), so no attack passes here only because its cheat silently broke.
Afterwards (`test_executor_healthy_and_controls_after_attacks`): /healthz is ok; the gold patch
of every synthesized task still resolves and the empty patch does not (so the suite cannot pass
blindly); no marker file exists that only host-side execution of planted git hooks could create;
the task set is intact; the executor left no task directory behind. It prints
`false_resolved=X/N patch_caused_infra_errors=Y/N` over the N attacks and asserts both are 0.

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
from dockyard_rl.data.synthesis import synthesize_swe_tasks, testing_sdists
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

_MiB = 1024 * 1024
_TASK_TIMEOUT_S = 60.0
_WAIT_TIMEOUT_S = 900.0
_GIT_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/nonexistent",
    "LANG": "C.UTF-8",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "GIT_TERMINAL_PROMPT": "0",
}


def _git(cwd: pathlib.Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(cwd), *args],
        env=_GIT_ENV,
        capture_output=True,
        text=True,
        errors="replace",
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} (in {cwd}) failed: {done.stderr.strip()}")
    return done.stdout


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


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    # A world-readable directory outside the paths the sandbox always hides (module docstring).
    parent = "/var/tmp" if os.access("/var/tmp", os.W_OK) else str(tmp_path_factory.getbasetemp())
    base = pathlib.Path(tempfile.mkdtemp(prefix="dockyard-attack-", dir=parent))
    base.chmod(0o755)
    taskset, work_dir = base / "taskset", base / "executor"
    archive = testing_sdists.make_toy_sdist(base / "downloads")
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
        patches = {}
        for attack in ATTACKS:
            patch = build_patch(attack, checkout, ctx)
            assert patch.strip(), f"{attack.name}: built an empty patch"
            added = {line[1:].strip() for line in patch.splitlines() if line.startswith("+")}
            assert not gold_added & added, f"{attack.name}: the patch carries the gold fix"
            patches[attack.name] = patch

        specs = [
            target.to_task_spec(patches[a.name], timeout_s=a.timeout_s, task_id=f"attack-{a.name}")
            for a in ATTACKS
        ]
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        start = time.monotonic()
        results = asyncio.run(_score_all(executor.url, specs))
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
        yield _Suite(
            url=executor.url,
            executor=executor,
            base=base,
            taskset=taskset,
            work_dir=work_dir,
            pwned_path=pwned_path,
            instances=instances,
            target=target,
            patches=patches,
            outcomes=outcomes,
            attacks_wall_s=wall_s,
            max_rss_growth_mib=rss_growth,
        )
    finally:
        executor.stop()
        _remove_tree(base)


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
    assert verdict.failure_kind in attack.expected, (
        f"{attack.name}: failure_kind {verdict.failure_kind.value!r} not in "
        f"{sorted(k.value for k in attack.expected)}: {_describe(outcome)}"
    )


def naive_resolves(instance, patch: str, work: pathlib.Path) -> tuple[bool, str]:
    """Scores `patch` the way the executor did before issue 12, minus bubblewrap (so only run
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
