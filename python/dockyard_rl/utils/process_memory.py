"""This process's memory as Linux reports it in /proc/self: resident set size and its peak.

- `status_bytes("VmRSS")`: a size field of /proc/self/status (VmRSS = resident set now, VmHWM =
  its high-water mark, VmPeak, VmSize, ...) in bytes; None when the kernel does not report it.
- `reset_peak_rss()`: starts a new VmHWM window (writes "5" to /proc/self/clear_refs,
  Linux >= 4.0), so that a later `status_bytes("VmHWM")` is the peak since that call.

The resident set counts what allocators that bypass Python (torch's CPU tensors, jax, numpy)
hold, which tracemalloc does not see; it also counts shared pages mapped into the process.

Not covered: other operating systems (/proc/self/status missing: `status_bytes` raises OSError,
as `open` does), device memory (torch.cuda / jax report their own), child processes.
"""

from __future__ import annotations

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


def status_bytes(field: str) -> int | None:
    """The size field `field` of /proc/self/status ("VmRSS", "VmHWM", ...) in bytes (the kernel
    writes them in kB), or None when the file has no such field.

    Raises:
        OSError: /proc/self/status cannot be read (not Linux, no /proc).
    """
    with open(_STATUS) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return None


def reset_peak_rss() -> bool:
    """Resets VmHWM to the current resident set; False when the kernel refuses (no /proc,
    Linux < 4.0, or a read-only /proc)."""
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
