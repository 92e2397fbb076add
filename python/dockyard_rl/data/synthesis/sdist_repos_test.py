"""Tests of sdist_repos: unpacking, file roles, the bare repository's commits and diffs."""

import io
import subprocess
import sys
import tarfile

import pytest

from dockyard_rl.data.synthesis import bundled_sdists, sdist_repos


@pytest.fixture
def layout(tmp_path):
    archive = bundled_sdists.make_toy_sdist(tmp_path / "dl")
    return sdist_repos.unpack_sdist(archive, tmp_path / "src")


def test_is_test_module():
    assert sdist_repos.is_test_module("tests/test_a.py")
    assert sdist_repos.is_test_module("pkg/tests/helpers.py")
    assert sdist_repos.is_test_module("test_loose.py")
    assert sdist_repos.is_test_module("pkg/core_test.py")
    assert sdist_repos.is_test_module("conftest.py")
    assert not sdist_repos.is_test_module("pkg/testament.py")
    assert not sdist_repos.is_test_module("pkg/core.py")


def test_unpack_sorts_files_by_role(layout):
    assert (layout.name, layout.version) == ("toystats", "1.0")
    assert layout.source_files == (
        "toystats/__init__.py",
        "toystats/core.py",
        "toystats/window.py",
    )  # docs/conf.py is not source
    # The empty tests/__init__.py stays in every commit.
    assert layout.test_files == ("tests/conftest.py", "tests/test_core.py", "tests/test_window.py")
    assert layout.test_paths == ("tests",)
    assert layout.slug == "toystats"


def test_local_archive_path_is_used_as_is(tmp_path):
    archive = bundled_sdists.make_toy_sdist(tmp_path)
    assert sdist_repos.fetch_sdist(str(archive), tmp_path / "unused") == archive.resolve()
    with pytest.raises(sdist_repos.SdistError, match="no such file"):
        sdist_repos.fetch_sdist(str(tmp_path / "missing-1.0.tar.gz"), tmp_path)


def test_bundled_packages_are_written_without_network(tmp_path):
    archive = sdist_repos.fetch_sdist("bundled:toystats", tmp_path / "dl")
    assert archive.parent == tmp_path / "dl" and archive.name == "toystats-1.0.tar.gz"
    assert archive.read_bytes() == bundled_sdists.make_toy_sdist(tmp_path / "again").read_bytes()
    with pytest.raises(
        sdist_repos.SdistError, match="bundled: bundled:toystats, bundled:pocketcalc"
    ):
        sdist_repos.fetch_sdist("bundled:nope", tmp_path)


@pytest.mark.parametrize("name", sorted(bundled_sdists.BUNDLED))
def test_bundled_packages_pass_their_own_tests(tmp_path, name):
    # A bundled package's suite must pass unmutated, or no task can be synthesized from it.
    layout = sdist_repos.unpack_sdist(
        sdist_repos.fetch_sdist(f"bundled:{name}", tmp_path / "dl"), tmp_path / "src"
    )
    assert layout.name == name and layout.source_files and layout.test_files
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(layout.root),
            *layout.test_paths,
        ],
        cwd=layout.root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]


def _archive(tmp_path, files):
    path = tmp_path / "pkg-1.0.tar.gz"
    with tarfile.open(path, "w:gz") as tarred:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tarred.addfile(info, io.BytesIO(data))
    return path


def test_sdist_without_tests_is_refused(tmp_path):
    archive = _archive(
        tmp_path,
        {"pkg-1.0/PKG-INFO": "Name: pkg\nVersion: 1.0\n", "pkg-1.0/pkg/__init__.py": "x = 1\n"},
    )
    with pytest.raises(sdist_repos.SdistError, match="ships no test modules"):
        sdist_repos.unpack_sdist(archive, tmp_path / "src")


def test_archive_escaping_its_root_is_refused(tmp_path):
    archive = _archive(tmp_path, {"../evil.py": "x = 1\n"})
    with pytest.raises(Exception, match="outside|escape|path"):
        sdist_repos.unpack_sdist(archive, tmp_path / "src")
    assert not (tmp_path / "evil.py").exists()


def test_repository_commits_and_diffs(layout, tmp_path):
    repo = sdist_repos.SdistRepository.create(tmp_path / "repos" / "toystats.git", layout)
    files = subprocess.run(
        ["git", "--git-dir", str(repo.path), "ls-tree", "-r", "--name-only", repo.pristine],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "tests/test_core.py" in files and "tests/data/samples.txt" in files
    screening = subprocess.run(
        ["git", "--git-dir", str(repo.path), "ls-tree", "-r", "--name-only", repo.screening],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert "tests/test_core.py" not in screening
    assert "tests/__init__.py" in screening and "tests/data/samples.txt" in screening
    # The screening test patch adds exactly the held-out modules.
    patch = repo.screening_test_patch
    assert patch.count("new file mode") == 3 and "+def test_total():" in patch

    original = repo.read(repo.pristine, "toystats/core.py")
    changed = repo.commit_files(
        repo.pristine,
        {"toystats/core.py": original.replace("value > best", "value >= best")},
        "edit",
        ref="refs/tasks/t1",
    )
    diff = repo.diff(changed, repo.pristine, ["toystats/core.py"])
    assert "-        if best is None or value >= best:" in diff
    assert "+        if best is None or value > best:" in diff
    refs = subprocess.run(
        ["git", "--git-dir", str(repo.path), "show-ref"], capture_output=True, text=True, check=True
    ).stdout
    assert f"{changed} refs/tasks/t1" in refs

    # Same content -> same commit ids (fixed dates): task ids are reproducible.
    again = sdist_repos.SdistRepository.create(tmp_path / "repos2" / "toystats.git", layout)
    assert (again.pristine, again.screening) == (repo.pristine, repo.screening)


def test_src_layout(tmp_path):
    archive = bundled_sdists.make_toy_sdist(tmp_path / "dl", src_layout=True)
    layout = sdist_repos.unpack_sdist(archive, tmp_path / "src")
    assert layout.source_files == (
        "src/toystats/__init__.py",
        "src/toystats/core.py",
        "src/toystats/window.py",
    )
    # The toy's tests/pytest.ini is the config pytest picks: paths are relative to tests/.
    assert layout.import_paths == ("../src",)
    flat = sdist_repos.unpack_sdist(
        bundled_sdists.make_toy_sdist(tmp_path / "dl2"), tmp_path / "src2"
    )
    assert flat.import_paths == ()
