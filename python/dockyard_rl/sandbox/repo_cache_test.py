import multiprocessing
import pathlib
import threading

import pytest

from dockyard_rl.sandbox import repo_cache
from dockyard_rl.sandbox.testing_repos import OPS_BASE, git, make_toy_repo


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return make_toy_repo(tmp_path_factory.mktemp("cache") / "toy")


def test_checkout_is_at_base_with_no_way_to_the_fix(toy, tmp_path):
    cache = repo_cache.RepoCache(tmp_path / "cache")
    dest = tmp_path / "repo"
    cache.checkout(str(toy.path), toy.base_commit, dest)
    assert git(dest, "rev-parse", "HEAD").strip() == toy.base_commit
    assert (dest / "calc" / "ops.py").read_text() == OPS_BASE
    assert git(dest, "status", "--porcelain") == ""
    # No remotes, tags, branches or other refs; only the one commit (SWE-bench #465).
    assert git(dest, "remote") == ""
    assert git(dest, "tag") == ""
    assert git(dest, "for-each-ref") == ""
    assert git(dest, "log", "--all", "--format=%H").split() == [toy.base_commit]
    objects = git(dest, "cat-file", "--batch-all-objects", "--batch-check")
    assert toy.fix_commit not in objects
    fixed_blob = git(toy.path, "rev-parse", f"{toy.fix_commit}:calc/ops.py").strip()
    assert fixed_blob not in objects
    assert not (dest / ".git" / "FETCH_HEAD").exists()
    assert not (dest / ".git" / "objects" / "info" / "alternates").exists()


def test_mirror_is_fetched_once_and_reused(toy, tmp_path):
    cache = repo_cache.RepoCache(tmp_path / "cache")
    mirror = cache.ensure_mirror(str(toy.path), toy.base_commit)
    marker = mirror / "dockyard-marker"
    marker.write_text("still the same mirror")
    # The same repository named three ways maps to the same mirror.
    for name in (str(toy.path), toy.path.as_uri(), f"{toy.path}/"):
        assert cache.ensure_mirror(name, toy.base_commit) == mirror
    assert marker.exists()
    assert sorted(p.name for p in cache.cache_dir.glob("*.git")) == [mirror.name]


def test_new_commits_are_fetched_when_needed(tmp_path):
    toy = make_toy_repo(tmp_path / "toy")
    cache = repo_cache.RepoCache(tmp_path / "cache")
    cache.ensure_mirror(str(toy.path), toy.base_commit)
    (toy.path / "NEWS").write_text("later\n")
    git(toy.path, "add", "NEWS")
    git(toy.path, "commit", "--quiet", "-m", "later")
    later = git(toy.path, "rev-parse", "HEAD").strip()
    cache.checkout(str(toy.path), later, tmp_path / "repo")
    assert (tmp_path / "repo" / "NEWS").exists()
    with pytest.raises(repo_cache.RepoCacheError, match="not found"):
        cache.ensure_mirror(str(toy.path), "0" * 40)


def test_abbreviated_commit_ids_work(toy, tmp_path):
    cache = repo_cache.RepoCache(tmp_path / "cache")
    cache.checkout(str(toy.path), toy.base_commit[:10], tmp_path / "repo")
    assert git(tmp_path / "repo", "rev-parse", "HEAD").strip() == toy.base_commit


@pytest.mark.parametrize(
    "repo",
    [
        "ext::sh -c touch% /tmp/pwned",
        "--upload-pack=touch /tmp/x",
        "ssh://host/repo.git",
        "git@github.com:a/b.git",
        "git://host/repo",
        "/does/not/exist",
        "",
    ],
)
def test_unsafe_or_unknown_repositories_are_refused(repo, tmp_path):
    with pytest.raises(ValueError, match="repo"):
        repo_cache.RepoCache(tmp_path / "cache").ensure_mirror(repo, "a" * 40)
    assert not pathlib.Path("/tmp/pwned").exists()


@pytest.mark.parametrize("commit", ["HEAD", "main", "--all", "abc", "g" * 40])
def test_commit_must_be_hexadecimal(toy, commit, tmp_path):
    with pytest.raises(ValueError, match="base_commit"):
        repo_cache.RepoCache(tmp_path / "cache").ensure_mirror(str(toy.path), commit)


def test_unreachable_https_repository_is_a_cache_error(tmp_path):
    with pytest.raises(repo_cache.RepoCacheError):
        # Port 9 on localhost: nothing listens, so git fails fast without any network.
        repo_cache.RepoCache(tmp_path / "cache").ensure_mirror(
            "https://127.0.0.1:9/x.git", "a" * 40
        )
    assert not list((tmp_path / "cache").glob("*.git"))


def _checkout_in_process(args):
    cache_dir, repo, commit, dest = args
    repo_cache.RepoCache(pathlib.Path(cache_dir)).checkout(repo, commit, pathlib.Path(dest))
    return (pathlib.Path(dest) / "calc" / "ops.py").read_text()


def test_concurrent_workers_share_one_clone(toy, tmp_path):
    cache_dir = tmp_path / "cache"
    errors = []

    def worker(i):
        try:
            repo_cache.RepoCache(cache_dir).checkout(
                str(toy.path), toy.base_commit, tmp_path / f"thread{i}"
            )
        except Exception as error:  # noqa: BLE001 - surfaced by the assertion below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    context = multiprocessing.get_context("fork")
    with context.Pool(2) as pool:
        texts = pool.map(
            _checkout_in_process,
            [
                (str(cache_dir), str(toy.path), toy.base_commit, str(tmp_path / f"proc{i}"))
                for i in range(2)
            ],
        )
    assert texts == [OPS_BASE, OPS_BASE]
    assert len(list(cache_dir.glob("*.git"))) == 1
    assert not list(cache_dir.glob(".clone-*"))  # staging directories were cleaned up
