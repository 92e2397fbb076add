"""Tests of dockyard_rl.utils.process_memory on this (Linux) machine's real /proc."""

import pathlib

import pytest

from dockyard_rl.utils import process_memory

pytestmark = pytest.mark.skipif(
    not pathlib.Path("/proc/self/status").exists(), reason="no /proc/self/status (not Linux)"
)


def test_status_bytes_reads_sizes_in_bytes():
    rss = process_memory.status_bytes("VmRSS")
    peak = process_memory.status_bytes("VmHWM")
    assert rss is not None and peak is not None
    assert rss > 1 << 20 and rss % 1024 == 0  # a Python process holds more than 1 MiB
    assert peak >= rss
    assert process_memory.status_bytes("NoSuchField") is None
    assert process_memory.status_bytes("VmRS") is None  # the whole field name, not a prefix


def test_reset_peak_rss_starts_a_new_window():
    block = bytearray(64 << 20)  # touched: 64 MiB resident
    block[::4096] = b"\x01" * len(block[::4096])
    peak_with_block = process_memory.status_bytes("VmHWM")
    del block
    if not process_memory.reset_peak_rss():
        pytest.skip("/proc/self/clear_refs is not writable here")
    assert process_memory.status_bytes("VmHWM") < peak_with_block
