"""The sandbox image (//ubuntu-base:sandbox_image), read and run for real.

- Its Debian packages are exactly the lock's (the dpkg status inside the image vs
  ubuntu-base/sandbox_packages.lock.json), and its wheels exactly requirements/sandbox.lock.txt.
- Under podman (Debian's, run as root with its storage in the test's temp folder): the executor
  inside serves tasks of a real repository on a published 127.0.0.1 port; the gold patch
  resolves, the empty patch does not, a conftest that forces every test to pass is not resolved.
- A SWE-bench row whose tests use another runner (a Django-like repository, tests/swebench_rows.py)
  is graded inside the image by the official harness's command and log parser (the image's slim
  swebench install), not by the pytest runner.

Podman needs, on this kind of machine: `--runtime runc` (crun refuses the hybrid cgroup v1/v2
layout), explicit `--ulimit`s (the default RLIMIT_NOFILE is above what the machine allows), and for
the executor's own per-task bubblewrap `--cap-add SYS_ADMIN --cap-add NET_ADMIN --security-opt
seccomp=unconfined --security-opt unmask=/proc/*` (a task gets fresh namespaces, its own loopback
device and a fresh /proc, which a masked /proc forbids).
"""

from __future__ import annotations

import asyncio
import functools
import gzip
import io
import json
import os
import pathlib
import re
import secrets
import shutil
import socket
import subprocess
import tarfile
import time
import uuid

import pytest

from dockyard_rl.sandbox.client import ExecutorClient
from dockyard_rl.sandbox.task import FailureKind, TestOutcome
from dockyard_rl.sandbox.testing_repos import make_toy_repo
from tests.swebench_rows import F2P, P2P, make_django_like_repo
from tools.oci import oci

WORKSPACE = pathlib.Path(__file__).absolute().parents[1]  # also the runfiles root
IMAGE = WORKSPACE / "ubuntu-base" / "sandbox_image.tar"
TAG = "dockyard/ubuntu-swe:latest"
PODMAN_RUN_OPTIONS = ["--runtime", "runc"]
CONTAINER_OPTIONS = [
    "--ulimit",
    "nofile=20000:20000",
    "--ulimit",
    "nproc=4096:4096",
    "--cap-add",
    "SYS_ADMIN",
    "--cap-add",
    "NET_ADMIN",
    "--security-opt",
    "seccomp=unconfined",
    "--security-opt",
    "unmask=/proc/*",
]


@functools.cache  # the 85 MB image is read once per test module, not once per test
def _layers() -> list[bytes]:
    with tarfile.open(IMAGE) as tarred:
        blobs = {m.name: tarred.extractfile(m).read() for m in tarred.getmembers() if m.isfile()}
    index = json.loads(blobs["index.json"])
    manifest = json.loads(blobs[f"blobs/sha256/{index['manifests'][0]['digest'][7:]}"])
    return [blobs[f"blobs/sha256/{layer['digest'][7:]}"] for layer in manifest["layers"]]


def _layer_file(layer: bytes, name: str) -> bytes:
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(layer))) as tarred:
        return tarred.extractfile(name).read()


def test_the_image_holds_exactly_the_locked_debian_packages():
    lock = json.loads((WORKSPACE / "ubuntu-base" / "sandbox_packages.lock.json").read_text())
    status = _layer_file(_layers()[0], "var/lib/dpkg/status").decode()
    installed = set()
    for paragraph in status.strip().split("\n\n"):
        fields = dict(
            line.split(": ", 1)
            for line in paragraph.splitlines()
            if ": " in line and not line.startswith(" ")
        )
        assert fields["Status"] == "install ok installed"
        installed.add((fields["Package"], fields["Version"], fields["Architecture"]))
    assert installed == {(p["name"], p["version"], p["architecture"]) for p in lock["packages"]}
    assert {"git", "patch", "bubblewrap", "python3"} <= {name for name, _, _ in installed}


def test_the_image_holds_exactly_the_locked_wheels():
    pins = dict(
        re.findall(
            r"^([A-Za-z0-9_.\-]+)==(\S+) \\$",
            (WORKSPACE / "requirements" / "sandbox.lock.txt").read_text(),
            re.M,
        )
    )
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(_layers()[1]))) as tarred:
        names = [m.name for m in tarred.getmembers()]
    found = {}
    for name in names:
        match = re.fullmatch(
            r"usr/local/lib/python3\.11/dist-packages/(.+)-([^-]+)\.dist-info", name
        )
        if match:
            found[match[1].lower().replace("_", "-")] = match[2]
    assert found == {name.lower().replace("_", "-"): version for name, version in pins.items()}


@pytest.mark.skipif(
    shutil.which("skopeo") is None,
    reason="skopeo is not installed (tools/bazel installs Debian's skopeo)",
)
def test_skopeo_reads_the_image(tmp_path):
    run = subprocess.run(
        ["skopeo", "--tmpdir", str(tmp_path), "inspect", "--config", f"oci-archive:{IMAGE}"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    config = json.loads(run.stdout)
    assert config["config"]["Entrypoint"] == [
        "/usr/bin/python3",
        "-m",
        "dockyard_rl.sandbox.executor",
    ]
    assert "DOCKYARD_FLEET_ROLE=sandbox" in config["config"]["Env"]
    assert config["config"]["ExposedPorts"] == {"9090/tcp": {}}
    assert len(config["rootfs"]["diff_ids"]) == 3


def test_layers_rebuilt_from_the_same_inputs_are_the_same_bytes(tmp_path):
    # The image's first two layers, written again by the same tool: the Debian root from the
    # repository rule's tarball, the Python layer from its own files unpacked into a folder.
    # Equal bytes, so equal digests, wherever and whenever they are built.
    external = WORKSPACE.parent  # the runfiles root holds every repository side by side
    layers = _layers()
    oci.write_layer(tmp_path / "0.tar.gz", [], tars=[external / "sandbox_rootfs" / "rootfs.tar"])
    assert (tmp_path / "0.tar.gz").read_bytes() == layers[0]
    python_layer = external / "sandbox_site_packages" / "layer.tar.gz"
    assert python_layer.read_bytes() == layers[1]
    with tarfile.open(python_layer) as tarred:
        tarred.extractall(tmp_path / "unpacked", filter="tar")  # "tar" keeps the modes as stored
    site = "usr/local/lib/python3.11/dist-packages"
    oci.write_layer(tmp_path / "1.tar.gz", [], trees=[(site, tmp_path / "unpacked" / site)])
    assert (tmp_path / "1.tar.gz").read_bytes() == layers[1]


@pytest.mark.skipif(
    shutil.which("umoci") is None,
    reason="umoci is not installed (tools/bazel installs Debian's umoci)",
)
def test_umoci_unpacks_the_image(tmp_path):
    with tarfile.open(IMAGE) as tarred:
        tarred.extractall(tmp_path / "layout", filter="data")
    run = subprocess.run(
        [
            "umoci",
            "unpack",
            "--rootless",
            "--image",
            f"{tmp_path / 'layout'}:latest",
            str(tmp_path / "bundle"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    rootfs = tmp_path / "bundle" / "rootfs"
    for path in (
        "usr/bin/python3",
        "usr/bin/git",
        "usr/bin/bwrap",
        "usr/bin/prlimit",
        "opt/dockyard/dockyard_rl/sandbox/executor.py",
    ):
        assert (rootfs / path).exists(), path
    assert (rootfs / "bin").is_symlink() and (rootfs / "bin").readlink() == pathlib.Path("usr/bin")
    site = rootfs / "usr/local/lib/python3.11/dist-packages"
    assert list(site.glob("pytest-*.dist-info"))
    # The harness's modules (swebench_harness.py), without the clients it never uses.
    assert (site / "swebench/harness/log_parsers/python.py").exists()
    assert not (site / "docker").exists() and not (site / "datasets").exists()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Podman:
    """podman as root with a private store under `root` (nothing left in /var/lib/containers)."""

    def __init__(self, root: pathlib.Path):
        self.command = [
            "podman",
            "--root",
            str(root / "storage"),
            "--runroot",
            str(root / "run"),
            *PODMAN_RUN_OPTIONS,
        ]
        # Bazel's test PATH lacks the sbin folders where podman's network helpers look for
        # iptables.
        self.env = {
            **os.environ,
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        }

    def __call__(self, *args: str, timeout: float = 300, check: bool = True) -> str:
        run = subprocess.run(
            [*self.command, *args], capture_output=True, text=True, timeout=timeout, env=self.env
        )
        if check and run.returncode != 0:
            raise AssertionError(f"podman {args[0]} exited {run.returncode}: {run.stderr}")
        return run.stdout + run.stderr


@pytest.fixture(scope="module")
def executor_url(tmp_path_factory):
    if shutil.which("podman") is None or shutil.which("runc") is None:
        pytest.skip("podman and runc are not installed (tools/bazel installs Debian's)")
    podman = Podman(tmp_path_factory.mktemp("podman"))
    podman("load", "--quiet", "--input", str(IMAGE), timeout=600)
    repos = tmp_path_factory.mktemp("repos")
    port, name = _free_port(), f"dockyard-sandbox-{uuid.uuid4().hex[:8]}"
    # Off loopback (inside its container) the executor refuses to serve without a token.
    token = secrets.token_hex(16)
    podman(
        "run",
        "--detach",
        "--name",
        name,
        *CONTAINER_OPTIONS,
        "--env",
        f"DOCKYARD_EXECUTOR_TOKEN={token}",
        "--publish",
        f"127.0.0.1:{port}:9090",
        "--volume",
        f"{repos}:{repos}:ro",
        TAG,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                asyncio.run(_healthz(url, token))
                break
            except Exception as error:
                state = podman("inspect", "--format", "{{.State.Status}}", name).strip()
                assert state == "running" and time.monotonic() < deadline, (
                    f"the executor never answered ({error}); container {state}: "
                    f"{podman('logs', name, check=False)}"
                )
                time.sleep(1)
        yield url, token, repos
    finally:
        podman("rm", "--force", "--time", "5", name, check=False, timeout=120)
        # Unmounts the private store's overlay and deletes it (else the temp folder stays busy).
        podman("system", "reset", "--force", check=False, timeout=120)


async def _healthz(url: str, token: str) -> None:
    async with ExecutorClient(url, auth_token=token, request_timeout_s=5) as client:
        await client.healthz()


async def _score(url: str, token: str, spec):
    async with ExecutorClient(url, auth_token=token) as client:
        return await client.score(spec, poll_interval_s=0.5, timeout_s=300)


def test_the_executor_in_the_image_scores_real_tasks(executor_url):
    url, token, repos = executor_url
    toy = make_toy_repo(repos / "toy")
    hostile_conftest = (
        "import pytest\n\n@pytest.hookimpl(hookwrapper=True)\n"
        "def pytest_runtest_makereport(item, call):\n    outcome = yield\n"
        "    outcome.get_result().outcome = 'passed'\n"
    )
    gold = asyncio.run(_score(url, token, toy.spec(toy.gold_patch, task_id="image-gold")))
    empty = asyncio.run(_score(url, token, toy.spec("", task_id="image-empty")))
    hostile_patch = toy.patch_for({"conftest.py": hostile_conftest})
    hostile = asyncio.run(_score(url, token, toy.spec(hostile_patch, task_id="image-hostile")))
    assert gold.verdict is not None and gold.verdict.resolved, gold
    assert empty.verdict is not None and not empty.verdict.resolved, empty
    assert hostile.verdict is not None and not hostile.verdict.resolved, hostile
    assert hostile.verdict.integrity_violation == ("conftest.py",)


def test_the_executor_in_the_image_grades_a_django_row_with_the_harness(executor_url):
    url, token, repos = executor_url
    repo = make_django_like_repo(repos / "django-like")
    gold = asyncio.run(_score(url, token, repo.spec(repo.gold_patch, task_id="image-dj-gold")))
    empty = asyncio.run(_score(url, token, repo.spec("", task_id="image-dj-empty")))
    assert gold.verdict is not None and gold.verdict.resolved, gold
    # The verdict comes from the harness's Django parser reading unittest's verbose lines (the
    # pytest runner would have produced neither the flag nor these lines).
    assert "evidence: parsed_log" in gold.verdict.screening_flags, gold.verdict
    assert f"{F2P} ... ok" in gold.verdict.log_tail
    assert gold.verdict.fail_to_pass == {F2P: TestOutcome.PASSED}
    assert empty.verdict is not None and not empty.verdict.resolved, empty
    assert empty.verdict.failure_kind is FailureKind.TESTS_FAILED
    assert empty.verdict.fail_to_pass == {F2P: TestOutcome.FAILED}
    assert empty.verdict.pass_to_pass == {P2P: TestOutcome.PASSED}
