import base64
import random
import subprocess
import time
import zlib

import pytest

from dockyard_rl.sandbox import apply, repo_cache
from dockyard_rl.sandbox.task import ApplyMethod
from dockyard_rl.sandbox.testing_repos import OPS_BASE, OPS_FIXED, git, make_toy_repo


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return make_toy_repo(tmp_path_factory.mktemp("apply") / "toy")


@pytest.fixture
def worktree(toy, tmp_path):
    cache = repo_cache.RepoCache(tmp_path / "cache")
    cache.checkout(str(toy.path), toy.base_commit, tmp_path / "repo")
    (tmp_path / "scratch").mkdir()
    return tmp_path / "repo"


def test_empty_patch(worktree, tmp_path):
    assert apply.apply_patch(worktree, "  \n", tmp_path / "scratch").method == ApplyMethod.EMPTY


def test_clean_patch_uses_git_apply(toy, worktree, tmp_path):
    result = apply.apply_patch(worktree, toy.gold_patch, tmp_path / "scratch")
    assert result.method == ApplyMethod.GIT_APPLY
    assert (worktree / "calc" / "ops.py").read_text() == OPS_FIXED


def test_missing_final_newline_is_tolerated(toy, worktree, tmp_path):
    result = apply.apply_patch(worktree, toy.gold_patch.rstrip("\n"), tmp_path / "scratch")
    assert result.method == ApplyMethod.GIT_APPLY


def test_drifted_context_falls_back_to_patch_fuzz(toy, worktree, tmp_path):
    # Line numbers and a context line are off: git apply refuses, GNU patch's fuzz copes.
    drifted = (
        "diff --git a/calc/ops.py b/calc/ops.py\n--- a/calc/ops.py\n+++ b/calc/ops.py\n"
        "@@ -20,9 +20,9 @@\n"
        " def sub(a, b):\n     return a - b\n \n \n def mul(a, b):\n-    return a + b\n"
        "+    return a * b\n \n \n def clamp_changed_context(value, low, high):\n"
    )
    result = apply.apply_patch(worktree, drifted, tmp_path / "scratch")
    assert result.method == ApplyMethod.PATCH_FUZZ, result.message
    assert (worktree / "calc" / "ops.py").read_text() == OPS_FIXED
    assert not list(worktree.rglob("*.orig")) and not list(worktree.rglob("*.rej"))


def test_three_way_merge_uses_the_index(toy, worktree, tmp_path):
    # A patch made against a slightly different version of the file: the index line names the
    # base blob, so --3way can merge where the plain apply cannot.
    base_blob = git(worktree, "rev-parse", "HEAD:calc/ops.py").strip()
    fixed_and_renamed = OPS_FIXED.replace("Small arithmetic helpers.", "Arithmetic helpers.")
    patch = toy.patch_for({"calc/ops.py": fixed_and_renamed})
    # Change the worktree's HEAD next to the docstring: the patch's context no longer matches.
    (worktree / "calc" / "ops.py").write_text(
        OPS_BASE.replace("def add(a, b):", "def add(a, b):  # sum")
    )
    git(worktree, "commit", "--quiet", "-am", "local change")
    assert base_blob in git(worktree, "cat-file", "--batch-all-objects", "--batch-check")
    result = apply.apply_patch(worktree, patch, tmp_path / "scratch")
    assert result.method == ApplyMethod.GIT_APPLY_3WAY, result.message
    merged = (worktree / "calc" / "ops.py").read_text()
    assert "return a * b" in merged and "Arithmetic helpers." in merged and "# sum" in merged


def test_failure_is_reported_and_the_tree_is_reset(toy, worktree, tmp_path):
    (worktree / "stray.txt").write_text("left over")
    result = apply.apply_patch(worktree, toy.conflicting_patch, tmp_path / "scratch")
    assert result.method == ApplyMethod.FAILED
    assert "git_apply" in result.message and "patch_fuzz" in result.message
    assert (worktree / "calc" / "ops.py").read_text() == OPS_BASE
    assert not (worktree / "stray.txt").exists()
    assert not list(worktree.rglob("*.rej"))


def test_half_applied_patch_does_not_leak_into_the_next_method(toy, worktree, tmp_path):
    # The first file applies, the second does not: git apply is atomic, GNU patch is not, and
    # the reset between tries must leave no trace of the partial attempt.
    partial = toy.gold_patch + toy.conflicting_patch.replace("calc/ops.py", "calc/__init__.py")
    result = apply.apply_patch(worktree, partial, tmp_path / "scratch")
    assert result.method == ApplyMethod.FAILED
    assert (worktree / "calc" / "ops.py").read_text() == OPS_BASE


# --- binary patches: declared sizes and the per-file limit ---------------------------------------


def binary_text(num_bytes: int, seed: int = 0) -> str:
    """Content git sees as binary (NULs, random bytes) for ToyRepo.patch_for, which writes str."""
    rng = random.Random(seed)
    return "\0" + "".join(chr(rng.randrange(256)) for _ in range(num_bytes - 1))


def git_base85(data: bytes) -> str:
    """Git's binary-hunk encoding of `data`: lines of <= 52 bytes, each a length letter + base85."""
    lines = []
    for start in range(0, len(data), 52):
        chunk = data[start : start + 52]
        letter = (
            chr(ord("A") + len(chunk) - 1) if len(chunk) <= 26 else chr(ord("a") + len(chunk) - 27)
        )
        lines.append(letter + base64.b85encode(chunk, pad=True).decode())
    return "\n".join(lines)


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        out.append((value & 0x7F) | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


def test_small_binary_patch_from_git_applies(toy, worktree, tmp_path):
    content = binary_text(3000)
    patch = toy.patch_for({"data/blob.bin": content})
    assert "GIT binary patch" in patch and "\nliteral " in patch
    declared = apply.binary_hunks(patch)
    # The new file's content forward, "literal 0" (no old content) in reverse.
    assert declared == apply.BinaryHunks(num_hunks=2, num_bytes=len(content.encode()))
    assert apply.binary_patch_bytes(patch) == len(content.encode())
    result = apply.apply_patch(worktree, patch, tmp_path / "scratch")
    assert result.method == ApplyMethod.GIT_APPLY and not result.too_large, result.message
    assert (worktree / "data" / "blob.bin").read_bytes() == content.encode()


def test_binary_delta_from_git_counts_its_result_size(tmp_path):
    repo = tmp_path / "bin"
    repo.mkdir()
    git(repo, "init", "--quiet")
    blob = random.Random(1).randbytes(40_000)
    (repo / "blob.bin").write_bytes(blob)
    git(repo, "add", "-A")
    git(repo, "commit", "--quiet", "-m", "base")
    changed = blob[:20_000] + b"edited in the middle" + blob[20_000:]
    (repo / "blob.bin").write_bytes(changed)
    patch = git(repo, "diff", "--binary")
    git(repo, "checkout", "--quiet", "--", ".")
    assert "\ndelta " in patch, patch[:300]
    declared = apply.binary_hunks(patch)
    assert declared.num_hunks == 2
    # Both delta bodies are small; the forward delta's header declares the new file's size.
    assert len(changed) <= declared.num_bytes < len(changed) + 1000
    (tmp_path / "scratch").mkdir()
    result = apply.apply_patch(repo, patch, tmp_path / "scratch", max_binary_bytes=50_000)
    assert result.method == ApplyMethod.GIT_APPLY, result.message
    assert (repo / "blob.bin").read_bytes() == changed
    refused = apply.apply_patch(repo, patch, tmp_path / "scratch", max_binary_bytes=39_000)
    assert refused.method == ApplyMethod.FAILED and refused.too_large


def test_literal_declaring_2_gib_is_refused_before_anything_runs(toy, worktree, tmp_path):
    real = toy.patch_for({"data/blob.bin": binary_text(3000)})
    header = next(
        line for line in real.split("\n") if line.startswith("literal ") and line != "literal 0"
    )
    crafted = real.replace(header + "\n", "literal 2147483648\n", 1)
    start = time.monotonic()
    result = apply.apply_patch(worktree, crafted, tmp_path / "scratch")
    assert time.monotonic() - start < 1.0
    assert result.method == ApplyMethod.FAILED and result.too_large
    assert (
        "2147483648 bytes" in result.message
        and str(apply.DEFAULT_MAX_BINARY_BYTES) in result.message
    )
    assert list((tmp_path / "scratch").iterdir()) == []  # not even the patch file was written
    assert git(worktree, "status", "--porcelain", "--ignored") == ""


def test_small_delta_declaring_a_2_gib_result_is_refused(toy, worktree, tmp_path):
    # A 20-byte delta whose header says "the result is 2 GiB" (its copy op would repeat 64 KiB of
    # the source): the hunk itself declares 20 bytes, the header is what counts.
    delta = varint(100) + varint(1 << 31) + bytes([0x80 | 0x10, 100])  # copy 100 bytes at 0
    crafted = (
        "diff --git a/calc/ops.py b/calc/ops.py\n"
        "index 1111111..2222222 100644\n"
        "GIT binary patch\n"
        f"delta {len(delta)}\n{git_base85(zlib.compress(delta))}\n\n"
        f"delta {len(delta)}\n{git_base85(zlib.compress(delta))}\n\n"
    )
    declared = apply.binary_hunks(crafted)
    assert declared.num_hunks == 2 and declared.num_bytes == 2 * len(delta) + (1 << 31)
    result = apply.apply_patch(worktree, crafted, tmp_path / "scratch")
    assert result.method == ApplyMethod.FAILED and result.too_large
    assert list((tmp_path / "scratch").iterdir()) == []


def test_file_size_limit_stops_an_applier_even_within_the_declared_cap(toy, worktree, tmp_path):
    content = binary_text(64 * 1024, seed=2)
    patch = toy.patch_for({"data/blob.bin": content})
    result = apply.apply_patch(
        worktree, patch, tmp_path / "scratch", max_binary_bytes=1 << 24, max_file_bytes=16 * 1024
    )
    assert result.method == ApplyMethod.FAILED and result.too_large, result.message
    assert "per-file limit" in result.message
    # git died holding .git/index.lock: the reset after it (and before the next method) must
    # still work, or the patch would have made its verdict an infrastructure error.
    assert not (worktree / "data").exists()
    assert git(worktree, "status", "--porcelain") == ""
    # Under the default limits the same patch applies.
    result = apply.apply_patch(worktree, patch, tmp_path / "scratch", max_binary_bytes=1 << 24)
    assert result.method == ApplyMethod.GIT_APPLY and not result.too_large, result.message


def test_text_patches_are_unaffected_by_the_binary_cap(toy, worktree, tmp_path):
    assert apply.binary_hunks(toy.gold_patch) == apply.BinaryHunks(0, 0)
    result = apply.apply_patch(
        worktree, toy.gold_patch, tmp_path / "scratch", max_binary_bytes=1, max_file_bytes=64 * 1024
    )
    assert result.method == ApplyMethod.GIT_APPLY and not result.too_large
    assert (worktree / "calc" / "ops.py").read_text() == OPS_FIXED
    failed = apply.apply_patch(worktree, toy.conflicting_patch, tmp_path / "scratch")
    assert failed.method == ApplyMethod.FAILED and not failed.too_large


def test_declared_sizes_are_read_as_git_reads_them():
    def section(*hunk_headers: str) -> str:
        body = "".join(f"{header}\nHcmV?d00001\n\n" for header in hunk_headers)
        return f"diff --git a/x b/x\nindex 1..2\nGIT binary patch\n{body}"

    assert apply.binary_hunks(section("literal 12", "literal 0")) == apply.BinaryHunks(2, 12)
    assert apply.binary_patch_bytes(section("literal  +12abc")) == 12  # strtoul: blanks, sign
    assert apply.binary_patch_bytes(section("literal 000000000000000000000000012")) == 12
    assert apply.binary_patch_bytes(section("literal -1")) == 2**64 - 1  # wraps in C
    assert apply.binary_patch_bytes(section("literal 99999999999999999999999")) == 2**64 - 1
    assert apply.binary_patch_bytes(section("literal x")) == 0
    # Outside a binary section (text lines, after the next header) nothing counts.
    text = (
        "diff --git a/x b/x\n--- a/x\n+++ b/x\n@@ -1 +1,2 @@\n a\n+literal 999999\nliteral 999999\n"
    )
    assert apply.binary_hunks(text) == apply.BinaryHunks(0, 0)
    assert apply.binary_patch_bytes(section("literal 5") + text) == 5


@pytest.mark.parametrize(
    "limits",
    [
        {"max_binary_bytes": 0},
        {"max_file_bytes": -1},
        {"max_binary_bytes": True},
        {"max_file_bytes": 1.5},
    ],
)
def test_limits_must_be_positive_integers(worktree, tmp_path, limits):
    with pytest.raises(ValueError, match=next(iter(limits))):
        apply.apply_patch(worktree, "diff --git a/x b/x\n", tmp_path / "scratch", **limits)


def test_cat_file_batch_reads_blobs_and_misses_in_one_process(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "a b.py").write_bytes(b"x = 1\n")
    (repo / "bin").write_bytes(bytes(range(256)))
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True)
    subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "b"],
        check=True,
    )
    names = ["HEAD:a b.py", "HEAD:bin", "HEAD:missing 1 2", "HEAD:", "0" * 40]
    found = apply.cat_file_batch(repo, names)
    assert found == {
        "HEAD:a b.py": b"x = 1\n",
        "HEAD:bin": bytes(range(256)),
        "HEAD:missing 1 2": None,
        "HEAD:": None,  # a tree, not a blob
        "0" * 40: None,
    }
    with pytest.raises(apply.GitError, match="cat-file"):
        apply.cat_file_batch(tmp_path, ["HEAD:x"])  # not a repository
