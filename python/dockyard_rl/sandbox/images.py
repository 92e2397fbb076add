"""Task images: the OCI image a task's tests run in, unpacked once into a size-bounded cache.

    cache = ImageCache(cache_dir, max_bytes=20 * 1024**3)
    with cache.lease("oci-archive:/data/images/astropy.tar") as image:   # ImageError if bad
        image.rootfs       # the unpacked root filesystem (read-only to everyone but the cache)
        image.env          # the image config's Env, as a dict (PATH, ...)
        image.digest       # the manifest digest the cache is keyed by

References (`parse_reference`):
- `oci-archive:PATH[:TAG]`, or a PATH ending in `.tar`: an OCI image layout in a tarball (what
  our `oci_image` rule and `skopeo copy ... oci-archive:` write);
- `oci:DIR[:TAG]`, or a directory holding an `oci-layout` file: an OCI image layout;
- `docker://NAME[:TAG|@DIGEST]`: an image in a registry the executor's machine can reach, fetched
  with skopeo (which reads the usual registries.conf and auth files; nothing here names a host).

How: the manifest digest is read first (from the layout's index.json, or `skopeo inspect` for a
registry), so a cached image costs no copy. On a miss, `skopeo copy` brings the image into a
staging layout (skopeo verifies every blob against its digest: a truncated or corrupt archive
fails here), `umoci raw unpack` writes its root filesystem (whiteouts, hard links, symlinks and
modes as the layers say), the config's Env and WorkingDir are kept in `image.json`, the layout is
deleted and the staging folder is renamed to `images/<digest>` in one step, so a crash never
leaves a half-unpacked image where a lookup finds it.

Sharing and eviction: concurrent leases of one digest share one root (the second waits for the
first's unpack instead of unpacking again). After each unpack, least-recently-used images with no
lease are deleted until the cache is under `max_bytes`; an image in use is never deleted, so the
cache can exceed its limit while more distinct images are in use than fit. Last use survives a
restart (the mtime of `image.json`). One executor process owns a cache directory.

Errors: `ImageError` (a ValueError: the task names an image that does not exist, cannot be read
or is corrupt; retrying cannot help) and `ImageUnavailableError` (a registry could not be reached;
the caller retries). Neither affects other tasks or other images.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import pathlib
import secrets
import shutil
import subprocess
import tarfile
import threading
import time
from collections.abc import Iterator

from dockyard_rl.sandbox import cleanup

logger = logging.getLogger(__name__)

_MANIFEST_TYPES = (
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
)
_REF_NAME = "org.opencontainers.image.ref.name"
_TOOL_TIMEOUT_S = 3600.0  # copying or unpacking a multi-gigabyte image


class ImageError(ValueError):
    """The task's image does not exist, cannot be read or is corrupt."""


class ImageUnavailableError(RuntimeError):
    """The image's registry could not be reached; the same request may succeed later."""


@dataclasses.dataclass(frozen=True)
class ImageReference:
    """A parsed image reference: `transport` is oci-archive, oci or docker."""

    transport: str
    location: str  # the archive or layout path, or the registry name
    tag: str | None  # the layout's ref name (None: its only manifest)

    def skopeo_source(self) -> str:
        if self.transport == "docker":
            return f"docker://{self.location}"
        return f"{self.transport}:{self.location}" + (f":{self.tag}" if self.tag else "")


def parse_reference(reference: str) -> ImageReference:
    """Parses a task's `image` field (module docstring); raises ImageError naming the forms."""
    if not isinstance(reference, str) or not reference.strip():
        raise ImageError("image: must be a non-empty image reference")
    for transport in ("oci-archive", "oci"):
        if reference.startswith(transport + ":"):
            path, _, tag = reference[len(transport) + 1 :].partition(":")
            if not os.path.isabs(path):
                raise ImageError(
                    f"image: {reference!r}: the path of an {transport}: reference must be absolute"
                )
            return ImageReference(transport, path, tag or None)
    if reference.startswith("docker://"):
        return ImageReference("docker", reference[len("docker://") :], None)
    if os.path.isabs(reference):
        if os.path.isdir(reference):
            return ImageReference("oci", reference, None)
        return ImageReference("oci-archive", reference, None)
    raise ImageError(
        f"image: {reference!r} is not an image reference: use oci-archive:/PATH, "
        f"oci:/DIR, an absolute path to an OCI archive or layout, or "
        f"docker://NAME:TAG for a registry"
    )


@dataclasses.dataclass(frozen=True)
class Image:
    """One unpacked image, valid while its lease is held."""

    digest: str
    rootfs: pathlib.Path
    env: dict[str, str]
    working_dir: str


@dataclasses.dataclass
class _Entry:
    image: Image
    size_bytes: int
    last_used: float
    leases: int = 0


def _pick_manifest(index: dict, ref: ImageReference) -> str:
    manifests = [m for m in index.get("manifests", []) if m.get("mediaType") in _MANIFEST_TYPES]
    if ref.tag is not None:
        manifests = [m for m in manifests if m.get("annotations", {}).get(_REF_NAME) == ref.tag]
    if len(manifests) != 1:
        names = [m.get("annotations", {}).get(_REF_NAME) for m in index.get("manifests", [])]
        raise ImageError(
            f"image: {ref.location} has {len(manifests)} image manifests "
            f"matching {ref.tag or 'no tag'} (tags: {names}); name one as "
            f"{ref.transport}:{ref.location}:TAG"
        )
    digest = manifests[0].get("digest", "")
    if not digest.startswith("sha256:") or len(digest) != 71:
        raise ImageError(f"image: {ref.location}: manifest digest {digest!r} is not sha256")
    return digest


def _read_index(ref: ImageReference) -> dict:
    try:
        if ref.transport == "oci":
            return json.loads(pathlib.Path(ref.location, "index.json").read_bytes())
        with tarfile.open(ref.location, mode="r:") as archive:
            member = archive.getmember("index.json")
            return json.loads(archive.extractfile(member).read())
    except (OSError, KeyError, tarfile.TarError, json.JSONDecodeError, AttributeError) as error:
        raise ImageError(
            f"image: cannot read the OCI index of {ref.location}: {type(error).__name__}: {error}"
        ) from None


def _run_tool(argv: list[str], what: str, ref: ImageReference) -> str:
    try:
        done = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=_TOOL_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except FileNotFoundError:
        raise ImageUnavailableError(
            f"{argv[0]} is not installed; the executor needs skopeo and "
            f"umoci for tasks with an image"
        ) from None
    except subprocess.TimeoutExpired:
        raise ImageUnavailableError(
            f"{what} of {ref.skopeo_source()} took longer than {_TOOL_TIMEOUT_S:.0f} s"
        ) from None
    if done.returncode != 0:
        message = (done.stderr or done.stdout).strip()[-2000:]
        # A registry that did not answer is transient; anything about the image itself is not.
        if ref.transport == "docker" and any(
            s in message
            for s in (
                "connection refused",
                "no such host",
                "i/o timeout",
                "TLS handshake timeout",
                "503 Service Unavailable",
                "502 Bad Gateway",
                "too many requests",
            )
        ):
            raise ImageUnavailableError(f"{what} of {ref.skopeo_source()} failed: {message}")
        raise ImageError(f"image: {what} of {ref.skopeo_source()} failed: {message}")
    return done.stdout


def _tree_bytes(root: pathlib.Path) -> int:
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


class ImageCache:
    """Unpacked task images under `cache_dir`, at most about `max_bytes` of them (docstring)."""

    def __init__(self, cache_dir: pathlib.Path, max_bytes: int):
        self.cache_dir = pathlib.Path(cache_dir)
        self.max_bytes = max_bytes
        self._images_dir = self.cache_dir / "images"
        self._staging_dir = self.cache_dir / "staging"
        self._lock = threading.Lock()  # guards everything below
        self._entries: dict[str, _Entry] = {}
        self._unpacking: dict[str, threading.Lock] = {}
        self._digests: dict[tuple, str] = {}  # (path, size, mtime) -> digest of a local source
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self._images_dir.mkdir(parents=True, exist_ok=True)
        if self._staging_dir.exists():  # an unpack a crash interrupted
            cleanup.remove_tree(self._staging_dir, trash_dir=self.cache_dir / "trash")
        self._staging_dir.mkdir(exist_ok=True)
        for folder in sorted(self._images_dir.iterdir()):
            self._load_entry(folder)

    def stats(self) -> dict[str, float]:
        """Figures for the executor's /metrics (keys: hits, misses, evictions, bytes, images)."""
        with self._lock:
            return {
                "hits": self.hits,
                "misses": self.misses,
                "evictions": self.evictions,
                "bytes": sum(e.size_bytes for e in self._entries.values()),
                "images": len(self._entries),
            }

    @contextlib.contextmanager
    def lease(self, reference: str) -> Iterator[Image]:
        """The image's unpacked root, kept on disk until the block exits. Raises ImageError or
        ImageUnavailableError (module docstring)."""
        ref = parse_reference(reference)
        digest = self._source_digest(ref)
        entry = self._acquire(ref, digest)
        try:
            yield entry.image
        finally:
            with self._lock:
                entry.leases -= 1
                entry.last_used = time.time()
                with contextlib.suppress(OSError):
                    os.utime(entry.image.rootfs.parent / "image.json")
                evicted = self._evict_locked()
            self._remove(evicted)

    def _source_digest(self, ref: ImageReference) -> str:
        if ref.transport == "docker":
            out = _run_tool(
                ["skopeo", "inspect", "--format", "{{.Digest}}", ref.skopeo_source()],
                "inspect",
                ref,
            )
            return out.strip()
        try:
            stat = os.stat(ref.location)
        except OSError as error:
            raise ImageError(f"image: {ref.location}: {error.strerror}") from None
        marker = os.path.join(ref.location, "index.json") if ref.transport == "oci" else None
        key = (
            ref.location,
            ref.tag,
            stat.st_size,
            stat.st_mtime_ns,
            os.stat(marker).st_mtime_ns if marker and os.path.exists(marker) else None,
        )
        with self._lock:
            if key in self._digests:
                return self._digests[key]
        digest = _pick_manifest(_read_index(ref), ref)
        with self._lock:
            self._digests[key] = digest
        return digest

    def _acquire(self, ref: ImageReference, digest: str) -> _Entry:
        with self._lock:
            unpack_lock = self._unpacking.setdefault(digest, threading.Lock())
        with unpack_lock:  # one unpack per digest; later leases of it wait, then hit
            with self._lock:
                entry = self._entries.get(digest)
                if entry is not None:
                    entry.leases += 1
                    self.hits += 1
                    return entry
            entry = self._unpack(ref, digest)
            with self._lock:
                self._entries[digest] = entry
                entry.leases += 1
                self.misses += 1
                evicted = self._evict_locked()
            self._remove(evicted)
            return entry

    def _unpack(self, ref: ImageReference, digest: str) -> _Entry:
        started = time.monotonic()
        staging = self._staging_dir / secrets.token_hex(8)
        staging.mkdir()
        try:
            layout = staging / "layout"
            _run_tool(
                ["skopeo", "copy", "--quiet", ref.skopeo_source(), f"oci:{layout}:image"],
                "copy",
                ref,
            )
            config = self._config(layout, ref)
            _run_tool(
                ["umoci", "raw", "unpack", "--image", f"{layout}:image", str(staging / "rootfs")],
                "unpack",
                ref,
            )
            shutil.rmtree(layout)
            env = dict(item.partition("=")[::2] for item in config.get("Env") or [])
            meta = {
                "digest": digest,
                "source": ref.skopeo_source(),
                "env": env,
                "working_dir": config.get("WorkingDir") or "/",
                "size_bytes": _tree_bytes(staging / "rootfs"),
            }
            (staging / "image.json").write_text(json.dumps(meta, indent=1))
            final = self._images_dir / digest.split(":", 1)[1]
            if final.exists():  # left by a process that died between rename and bookkeeping
                cleanup.remove_tree(final, trash_dir=self.cache_dir / "trash")
            os.rename(staging, final)
        except OSError as error:
            raise ImageUnavailableError(
                f"unpacking {ref.skopeo_source()} failed on the executor's disk: {error}"
            ) from None
        finally:
            if staging.exists():
                cleanup.remove_tree(staging, trash_dir=self.cache_dir / "trash")
        logger.info(
            "image %s (%s): unpacked %.0f MB in %.1f s",
            ref.skopeo_source(),
            digest[:19],
            meta["size_bytes"] / 1e6,
            time.monotonic() - started,
        )
        return self._entry_from(final, meta)

    @staticmethod
    def _config(layout: pathlib.Path, ref: ImageReference) -> dict:
        """The image config's `config` object (Env, WorkingDir, ...) from a copied layout."""

        def blob(digest: str) -> dict:
            return json.loads((layout / "blobs" / "sha256" / digest.split(":", 1)[1]).read_bytes())

        try:
            index = json.loads((layout / "index.json").read_bytes())
            manifest = blob(index["manifests"][0]["digest"])
            return blob(manifest["config"]["digest"]).get("config") or {}
        except (KeyError, IndexError, TypeError, ValueError) as error:
            raise ImageError(
                f"image: {ref.skopeo_source()}: unreadable manifest or config: "
                f"{type(error).__name__}: {error}"
            ) from None

    @staticmethod
    def _entry_from(folder: pathlib.Path, meta: dict) -> _Entry:
        image = Image(
            digest=meta["digest"],
            rootfs=folder / "rootfs",
            env=dict(meta["env"]),
            working_dir=meta["working_dir"],
        )
        return _Entry(
            image=image,
            size_bytes=int(meta["size_bytes"]),
            last_used=(folder / "image.json").stat().st_mtime,
        )

    def _load_entry(self, folder: pathlib.Path) -> None:
        try:
            meta = json.loads((folder / "image.json").read_text())
            entry = self._entry_from(folder, meta)
        except (OSError, ValueError, KeyError) as error:
            logger.warning("image cache: removing unreadable entry %s (%s)", folder, error)
            cleanup.remove_tree(folder, trash_dir=self.cache_dir / "trash")
            return
        self._entries[entry.image.digest] = entry

    def _evict_locked(self) -> list[pathlib.Path]:
        """Drops least-recently-used unleased images until the cache fits; returns their folders,
        already renamed out of `images/` (so no lookup or unpack meets them), for `_remove`."""
        total = sum(e.size_bytes for e in self._entries.values())
        evicted = []
        for digest, entry in sorted(self._entries.items(), key=lambda item: item[1].last_used):
            if total <= self.max_bytes:
                break
            if entry.leases:
                continue
            del self._entries[digest]
            total -= entry.size_bytes
            self.evictions += 1
            doomed = self._staging_dir / f"evicted-{secrets.token_hex(8)}"
            try:
                os.rename(entry.image.rootfs.parent, doomed)
            except OSError as error:
                logger.warning("image cache: cannot evict %s: %s", digest[:19], error)
                continue
            logger.info("image cache: evicting %s (%.0f MB)", digest[:19], entry.size_bytes / 1e6)
            evicted.append(doomed)
        return evicted

    def _remove(self, folders: list[pathlib.Path]) -> None:
        for folder in folders:
            error = cleanup.remove_tree(folder, trash_dir=self.cache_dir / "trash")
            if error:
                logger.warning("image cache: %s", error)
