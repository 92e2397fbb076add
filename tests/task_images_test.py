"""Tasks that run in their own OCI image: real images built by our OCI rules, real skopeo and umoci,
real git, real pytest under real bubblewrap (the scoring pipeline, as the executor runs it).

The two images (tests/task_images/BUILD) each carry a stand-in third-party package the executor's
own interpreter lacks (moonphase, tinyunits). Each task's repository imports it, so:
- in its image, the gold patch resolves, the empty patch does not, a hostile conftest does not;
- without the image, the same gold patch fails (the tests cannot import the dependency), which is
  what a task needing its own environment got before per-task images.
Then the image cache: two tasks on one image unpack it once (also when they start together), a
size limit evicts the least recently used image, a truncated archive is a per-task error and the
next task scores normally.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import pathlib
import shutil

import pytest

from dockyard_rl.sandbox import images, pipeline
from dockyard_rl.sandbox.task import FailureKind, TaskSpec, TestOutcome
from dockyard_rl.sandbox.testing_repos import git

WORKSPACE = pathlib.Path(__file__).absolute().parents[1]  # also the runfiles root
MOONPHASE_IMAGE = WORKSPACE / "tests" / "task_images" / "moonphase_task_image.tar"
TINYUNITS_IMAGE = WORKSPACE / "tests" / "task_images" / "tinyunits_task_image.tar"

CONFIG = pipeline.PipelineConfig(
    timeout_s=120,
    cpu_time_s=120,
    memory_bytes=2 * 1024**3,
    max_num_processes=64,
    max_log_bytes=16 * 1024,
)

HOSTILE_CONFTEST = (
    "import pytest\n\n@pytest.hookimpl(hookwrapper=True)\n"
    "def pytest_runtest_makereport(item, call):\n"
    "    outcome = yield\n    outcome.get_result().outcome = 'passed'\n"
)


@dataclasses.dataclass(frozen=True)
class ImageTask:
    """A repository whose tests need the image's package, with its bug, fix and tests."""

    repo: pathlib.Path
    base_commit: str
    gold_patch: str
    test_patch: str
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    image: str
    repo_path: str

    def spec(self, patch: str, *, image: str | None = "default", task_id: str = "") -> TaskSpec:
        image = self.image if image == "default" else image
        return TaskSpec(
            instance_id=f"{self.repo.name}-1",
            repo=str(self.repo),
            base_commit=self.base_commit,
            patch=patch,
            test_patch=self.test_patch,
            fail_to_pass=self.fail_to_pass,
            pass_to_pass=self.pass_to_pass,
            image=image,
            repo_path=self.repo_path if image else "/testbed",
            task_id=task_id or None,
        )

    def patch_for(self, files: dict[str, str]) -> str:
        clone = self.repo.parent / f"{self.repo.name}-edit"
        shutil.rmtree(clone, ignore_errors=True)
        git(self.repo.parent, "clone", "--quiet", str(self.repo), str(clone))
        git(clone, "checkout", "--quiet", "--detach", self.base_commit)
        for name, text in files.items():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            (clone / name).write_text(text)
        git(clone, "add", "-A")
        return git(clone, "diff", "--cached", self.base_commit)


def _make_task(
    path: pathlib.Path,
    *,
    module: str,
    buggy: str,
    fixed: str,
    base_tests: str,
    new_tests: str,
    image: pathlib.Path,
    repo_path: str,
    fail_to_pass: tuple[str, ...],
    pass_to_pass: tuple[str, ...],
) -> ImageTask:
    path.mkdir(parents=True)
    git(path, "init", "--quiet", "--initial-branch=main")
    (path / "pkg").mkdir()
    (path / "pkg" / "__init__.py").write_text("")
    (path / "pkg" / f"{module}.py").write_text(buggy)
    (path / "tests").mkdir()
    (path / "tests" / "test_base.py").write_text(base_tests)
    git(path, "add", "-A")
    git(path, "commit", "--quiet", "-m", "base")
    base = git(path, "rev-parse", "HEAD").strip()
    (path / "pkg" / f"{module}.py").write_text(fixed)
    # The test patch adds to the file it touches, so the default command (pytest on the files
    # the test patch touches) runs the PASS_TO_PASS test too.
    (path / "tests" / "test_base.py").write_text(base_tests + "\n\n" + new_tests)
    git(path, "add", "-A")
    git(path, "commit", "--quiet", "-m", "fix")
    return ImageTask(
        repo=path,
        base_commit=base,
        gold_patch=git(path, "diff", base, "HEAD", "--", "pkg"),
        test_patch=git(path, "diff", base, "HEAD", "--", "tests"),
        fail_to_pass=fail_to_pass,
        pass_to_pass=pass_to_pass,
        image=f"oci-archive:{image}",
        repo_path=repo_path,
    )


@pytest.fixture(scope="module")
def moon(tmp_path_factory) -> ImageTask:
    body = "import moonphase\n\n\ndef name_of_phase(days):\n    return moonphase.PHASES[{}]\n"
    return _make_task(
        tmp_path_factory.mktemp("repos") / "lunar",
        module="calendar",
        buggy=body.format("moonphase.phase_index(days) - 1"),
        fixed=body.format("moonphase.phase_index(days)"),
        base_tests="import moonphase\n\n\ndef test_dependency_present():\n"
        "    assert moonphase.phase_index(0) == 0\n",
        new_tests="from pkg.calendar import name_of_phase\n\n\ndef test_full_moon():\n"
        "    assert name_of_phase(14.8) == 'full'\n",
        image=MOONPHASE_IMAGE,
        repo_path="/testbed",
        fail_to_pass=("tests/test_base.py::test_full_moon",),
        pass_to_pass=("tests/test_base.py::test_dependency_present",),
    )


@pytest.fixture(scope="module")
def units(tmp_path_factory) -> ImageTask:
    body = "from tinyunits import convert\n\n\ndef km_to_miles(km):\n    return {}\n"
    return _make_task(
        tmp_path_factory.mktemp("repos") / "runlog",
        module="distance",
        buggy=body.format("convert(km, 'mi', 'km')"),
        fixed=body.format("convert(km, 'km', 'mi')"),
        base_tests="from tinyunits import convert\n\n\ndef test_meters():\n"
        "    assert convert(1, 'km', 'm') == 1000\n",
        new_tests="from pkg.distance import km_to_miles\n\n\ndef test_marathon():\n"
        "    assert round(km_to_miles(42.195), 1) == 26.2\n",
        image=TINYUNITS_IMAGE,
        repo_path="/srv/checkout",
        fail_to_pass=("tests/test_base.py::test_marathon",),
        pass_to_pass=("tests/test_base.py::test_meters",),
    )


@pytest.fixture(scope="module")
def work_root(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("work")


def _score(task: ImageTask, work_root: pathlib.Path, patch: str, config=CONFIG, **kwargs):
    return pipeline.score_task(task.spec(patch, **kwargs), config, work_root)


@pytest.mark.parametrize("which", ["moon", "units"])
def test_gold_resolves_in_its_image_and_nothing_else_does(which, request, work_root):
    task: ImageTask = request.getfixturevalue(which)
    gold = _score(task, work_root, task.gold_patch)
    assert gold.resolved, (gold.failure_kind, gold.failure_detail, gold.log_tail[-3000:])
    assert "image" in gold.timings_s

    empty = _score(task, work_root, "")
    assert not empty.resolved and empty.failure_kind is FailureKind.TESTS_FAILED
    assert set(empty.fail_to_pass.values()) == {TestOutcome.FAILED}
    assert set(empty.pass_to_pass.values()) == {TestOutcome.PASSED}

    hostile = _score(task, work_root, task.patch_for({"conftest.py": HOSTILE_CONFTEST}))
    assert not hostile.resolved and hostile.failure_kind is FailureKind.INTEGRITY_VIOLATION

    # Without the image the tests run in the executor's interpreter, which lacks the package.
    outside = _score(task, work_root, task.gold_patch, image=None)
    assert not outside.resolved
    assert "ModuleNotFoundError" in outside.log_tail or "No module named" in outside.log_tail


def test_one_image_is_unpacked_once_for_concurrent_tasks(moon, tmp_path):
    config = dataclasses.replace(CONFIG, image_cache_dir=str(tmp_path / "images"))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        verdicts = list(
            pool.map(lambda i: _score(moon, tmp_path, moon.gold_patch, config=config), range(2))
        )
    assert all(v.resolved for v in verdicts)
    stats = pipeline.image_cache(config, tmp_path).stats()
    assert (stats["misses"], stats["hits"], stats["images"]) == (1, 1, 1), stats
    assert len(list((tmp_path / "images" / "images").iterdir())) == 1


def test_size_limit_evicts_the_least_recently_used_image(tmp_path):
    cache = images.ImageCache(tmp_path / "cache", max_bytes=1)  # smaller than any image
    with cache.lease(f"oci-archive:{MOONPHASE_IMAGE}") as first:
        with cache.lease(str(TINYUNITS_IMAGE)) as second:
            assert first.rootfs.is_dir() and second.rootfs.is_dir()  # in use: never evicted
            assert cache.stats()["images"] == 2
        assert not second.rootfs.exists()  # released and over the limit: gone
        assert first.rootfs.is_dir()
    assert cache.stats()["images"] == 0 and cache.stats()["evictions"] == 2

    roomy = images.ImageCache(tmp_path / "roomy", max_bytes=10**12)
    for reference in (str(MOONPHASE_IMAGE), str(TINYUNITS_IMAGE)):
        with roomy.lease(reference):
            pass
    one_image = roomy.stats()["bytes"] / 2
    roomy.max_bytes = int(one_image * 1.5)  # room for one: the older (moonphase) goes first
    with roomy.lease(str(TINYUNITS_IMAGE)) as kept:
        pass
    assert roomy.stats()["images"] == 1 and kept.rootfs.is_dir()
    # A restart finds what is on disk.
    again = images.ImageCache(tmp_path / "roomy", max_bytes=10**12)
    assert again.stats()["images"] == 1
    with again.lease(str(TINYUNITS_IMAGE)):
        assert again.stats()["hits"] == 1 and again.stats()["misses"] == 0


def test_a_corrupt_image_is_an_error_of_that_task_only(moon, tmp_path):
    truncated = tmp_path / "truncated.tar"
    data = MOONPHASE_IMAGE.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    config = dataclasses.replace(CONFIG, image_cache_dir=str(tmp_path / "images"))
    for bad in (
        f"oci-archive:{truncated}",
        f"oci-archive:{tmp_path / 'missing.tar'}",
        "relative/path.tar",
    ):
        with pytest.raises(ValueError, match="image"):
            _score(moon, tmp_path, moon.gold_patch, config=config, image=bad)
    assert _score(moon, tmp_path, moon.gold_patch, config=config).resolved
    assert list((tmp_path / "images" / "staging").iterdir()) == []  # nothing half-unpacked kept


def test_a_damaged_layer_fails_the_digest_check_of_the_copy(tmp_path):
    # The archive's structure and index.json stay intact; bytes inside the largest layer (the
    # middle of the file) do not, so only skopeo's digest verification can notice.
    data = bytearray(MOONPHASE_IMAGE.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 4096] = bytes(b ^ 0xFF for b in data[middle : middle + 4096])
    damaged = tmp_path / "damaged.tar"
    damaged.write_bytes(bytes(data))
    cache = images.ImageCache(tmp_path / "cache", max_bytes=10**12)
    with pytest.raises(images.ImageError, match="copy of oci-archive:"):
        with cache.lease(str(damaged)):
            pass
    assert cache.stats()["images"] == 0
    assert list((tmp_path / "cache" / "staging").iterdir()) == []
