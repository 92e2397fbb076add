"""How close a patch comes to the task's reference (gold) patch, as a number in [0, 1].

The `reference_similarity` shaping stage (`dockyard_rl.rewards.shaping`) pays part of it to a
patch that applied but did not resolve its task, as SWE-RL (Wei et al., 2025) rewards every patch
by its similarity to the oracle's. A small model that rarely resolves a multi-line task then still
learns which edits are near the fix (the changed line, a one-token change) and which are not (a
rewritten function, an unchanged copy).

`patch_similarity(patch, reference)`: `difflib.SequenceMatcher.ratio()` of the two patches'
CHANGED lines only: each removed line as "-text" and each added one as "+text", trailing
whitespace dropped, files in path order, hunks in file order. Diff headers, hunk ranges and
context lines are left out, so the same edit scores 1.0 whatever context the two diffs quote.
A patch that unidiff cannot parse, or that changes no line, scores 0.0.

Not covered: moved code (a fix made elsewhere in the file scores by its lines' text, not by its
effect); binary hunks (they carry no lines).
"""

from __future__ import annotations

import difflib
import functools

import unidiff

__all__ = ["changed_lines", "patch_similarity"]


# Every sample of a group is compared with the same reference patch: parse each one once.
@functools.lru_cache(maxsize=256)
def changed_lines(patch: str) -> str | None:
    """The removed and added lines of a unified diff as one "-text\\n+text" string, files in
    path order ("" when the patch changes no line); None when unidiff cannot parse it."""
    try:
        patch_set = unidiff.PatchSet(patch)
    except (unidiff.UnidiffParseError, ValueError):
        return None
    lines: list[str] = []
    for patched_file in sorted(patch_set, key=lambda patched: patched.path):
        for hunk in patched_file:
            for line in hunk:
                if line.is_removed or line.is_added:
                    lines.append(f"{line.line_type}{line.value.rstrip()}")
    return "\n".join(lines)


def patch_similarity(patch: str, reference: str) -> float:
    """SequenceMatcher ratio of the changed lines of `patch` and `reference`, in [0, 1]; 0.0
    when either cannot be parsed or changes nothing."""
    ours, theirs = changed_lines(patch), changed_lines(reference)
    if not ours or not theirs:
        return 0.0
    # autojunk off: its heuristic ignores frequent characters in texts over 200 characters,
    # which would make the ratio depend on the reference's length.
    return difflib.SequenceMatcher(None, ours, theirs, autojunk=False).ratio()
