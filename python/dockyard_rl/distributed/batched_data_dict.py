"""`BatchedDataDict`: the batch container passed across every seam of the GRPO loop.

Generation results, rewards, log-probs and training microbatches all travel as a
`BatchedDataDict`: a `dict` from field name to a batch field, where every field holds exactly one
entry per sample along dim 0. A field is either

- a `torch.Tensor` with at least one dim (any trailing dims: `input_ids_BS`, `rewards_B`), or
- a python `list` of per-sample objects (prompt strings, metadata dicts, instance ids).

Equal length along dim 0 is checked whenever fields change (construction, `__setitem__`,
`update`, `setdefault`, `|`, `|=`) and again by every operation, so a ragged batch fails where it
was made, with a `ValueError` naming each field and its length.

Which keys a batch holds is declared with a `TypedDict` and the generic parameter
(`BatchedDataDict[RolloutBatch]`; the GRPO loop's layouts are declared once, in
batch_layouts.py); that is for type checkers only. `validate(spec)` checks it at runtime (missing
keys, extra keys on request, and tensor-vs-list for fields annotated `torch.Tensor` /
`list[...]`).

Operations (all return new containers; the receiver is never modified):

- selection: `slice`, `select_indices`, `select_keys`;
- data-parallel sharding: `shard_by_batch_size` (optionally balanced by sequence length)
  returning a `ShardedBatch` whose `unshard` restores the original order of per-shard results;
- padding along dim 1 for variable-length sequences: `pad_sequences` and
  `BatchedDataDict.from_sequences`;
- microbatches: `make_microbatch_iterator` (fixed size);
- `concat`, `to`, `copy` (shallow).

Sharing: like torch indexing, `slice`/`select_keys`/`copy` give tensors that share storage with
the receiver (basic slicing returns views), while `select_indices`, `concat` and padding allocate
new tensors. Lists are always new list objects, but their elements are shared references.

Not covered: nested `BatchedDataDict`s as fields, numpy arrays or tuples as fields (convert them
to tensors / lists), and moving data between processes (Ray pickles the dict as-is).

Shape suffixes: B = batch (samples), S = sequence (tokens).
"""

from __future__ import annotations

import dataclasses
import heapq
import types
import typing
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar

import torch

# Covariant: a batch with more keys (`BatchedDataDict[RolloutBatch]`) may go where fewer are
# read (`BatchedDataDict[LogprobBatch]`), as its TypedDict is a subtype of the smaller one.
T_co = TypeVar("T_co", covariant=True)

# A batch field: a tensor with a leading batch dim, or a list of per-sample objects.
BatchField = torch.Tensor | list


def _describe(value: Any) -> str:
    """A short description of a field for error messages: its shape or its length."""
    if isinstance(value, torch.Tensor):
        return f"tensor of shape {tuple(value.shape)} ({value.dtype})"
    if isinstance(value, list):
        return f"list of length {len(value)}"
    return type(value).__name__


def _check_field(key: Any, value: Any) -> None:
    """Raises ValueError if `key`/`value` cannot be a batch field."""
    if not isinstance(key, str):
        raise ValueError(
            f"BatchedDataDict keys must be str field names, got {key!r} ({type(key).__name__})"
        )
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            raise ValueError(
                f"field {key!r} is a 0-dim tensor; batch fields need a leading batch "
                f"dim (one entry per sample): use value.reshape(1) for a single "
                f"sample or value.expand(batch_size) to broadcast it"
            )
        return
    if isinstance(value, list):
        return
    fix = (
        "convert it with list(...)"
        if isinstance(value, tuple)
        else ("convert it with torch.as_tensor(...) or list(...)")
    )
    raise ValueError(
        f"field {key!r} has type {type(value).__name__}; batch fields must be a "
        f"torch.Tensor with a leading batch dim or a list with one entry per "
        f"sample: {fix}"
    )


def _field_len(value: BatchField) -> int:
    return value.shape[0] if isinstance(value, torch.Tensor) else len(value)


def _check_equal_lengths(fields: Mapping[str, BatchField], context: str) -> None:
    """Raises ValueError naming every field and its length if they differ along dim 0."""
    lengths = {key: _field_len(value) for key, value in fields.items()}
    if len(set(lengths.values())) > 1:
        listing = ", ".join(f"{key!r} has {n}" for key, n in lengths.items())
        raise ValueError(
            f"{context}: fields differ in length along dim 0 ({listing}); every "
            f"field must hold exactly one entry per sample, so fix the producer of "
            f"the odd field(s) or build the batch from equally long fields"
        )


def _check_positive_int(value: Any, name: str, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}; {fix}")


def invert_permutation(permutation: Sequence[int]) -> list[int]:
    """Returns `inverse` with `inverse[permutation[i]] == i`.

    `batch.select_indices(p).select_indices(invert_permutation(p))` equals `batch`.

    Raises:
        ValueError: `permutation` is not a permutation of `range(len(permutation))`.
    """
    num_items = len(permutation)
    inverse = [-1] * num_items
    for position, original in enumerate(permutation):
        original = int(original)
        if not 0 <= original < num_items or inverse[original] != -1:
            raise ValueError(
                f"not a permutation of range({num_items}): entry {original} at "
                f"position {position} is out of range or repeated"
            )
        inverse[original] = position
    return inverse


def pad_sequences(
    sequences: Sequence[torch.Tensor | Sequence[int] | Sequence[float]],
    pad_value: float | int = 0,
    pad_to_length: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pads variable-length 1-D sequences into one `[B, S]` tensor.

    Args:
        sequences: B sequences, each a 1-D tensor or a python sequence of numbers (converted with
            `torch.as_tensor`, so token-id lists become int64). All must share dtype and device.
        pad_value: value of the padding positions.
        pad_to_length: S of the result; default the longest sequence's length. Lets every
            microbatch have the same width (e.g. the generation's max new tokens).

    Returns:
        (padded_BS, lengths_B): `padded_BS[b, :lengths_B[b]]` is sequence b; `lengths_B` is int64
        on the sequences' device.

    Raises:
        ValueError: no sequences (dtype and device cannot be inferred), a sequence that is not
            1-D, mixed dtypes or devices, or a sequence longer than `pad_to_length`.
    """
    if len(sequences) == 0:
        raise ValueError(
            "pad_sequences needs at least one sequence (the dtype and device of the "
            "result come from them); build an empty [0, S] tensor directly instead"
        )
    tensors_S = [
        seq if isinstance(seq, torch.Tensor) else torch.as_tensor(seq) for seq in sequences
    ]
    first = tensors_S[0]
    for index, seq_S in enumerate(tensors_S):
        if seq_S.dim() != 1:
            raise ValueError(
                f"pad_sequences: sequence {index} has shape {tuple(seq_S.shape)}; "
                f"every sequence must be 1-D (one sample's tokens)"
            )
        if seq_S.dtype != first.dtype or seq_S.device != first.device:
            raise ValueError(
                f"pad_sequences: sequence {index} is {seq_S.dtype} on "
                f"{seq_S.device} but sequence 0 is {first.dtype} on {first.device}; "
                f"convert them to one dtype and device first"
            )
    lengths_B = torch.tensor(
        [seq_S.shape[0] for seq_S in tensors_S], dtype=torch.int64, device=first.device
    )
    longest = int(lengths_B.max())
    width = longest if pad_to_length is None else pad_to_length
    if pad_to_length is not None:
        if (
            isinstance(pad_to_length, bool)
            or not isinstance(pad_to_length, int)
            or pad_to_length < 0
        ):
            raise ValueError(
                f"pad_to_length must be a non-negative int or None, got {pad_to_length!r}"
            )
        if longest > pad_to_length:
            index = int(lengths_B.argmax())
            raise ValueError(
                f"pad_sequences: sequence {index} has length {longest} > "
                f"pad_to_length={pad_to_length}; raise pad_to_length or truncate "
                f"the sequences first"
            )
    padded_BS = torch.full(
        (len(tensors_S), width), pad_value, dtype=first.dtype, device=first.device
    )
    for row, seq_S in enumerate(tensors_S):
        padded_BS[row, : seq_S.shape[0]] = seq_S
    return padded_BS, lengths_B


def _annotation_kinds(annotation: Any) -> set[type] | None:
    """The field types (`torch.Tensor`, `list`) an annotation allows; None if not checkable."""
    if annotation is torch.Tensor or annotation is list:
        return {annotation}
    origin = typing.get_origin(annotation)
    if origin is list:
        return {list}
    if origin is typing.Union or origin is types.UnionType:
        kinds: set[type] = set()
        for member in typing.get_args(annotation):
            if member is type(None):
                continue
            member_kinds = _annotation_kinds(member)
            if member_kinds is None:
                return None
            kinds |= member_kinds
        return kinds
    return None


def _required_keys(spec: type) -> set[str]:
    """The required keys of TypedDict `spec`.

    `spec.__required_keys__` alone is wrong when the spec's module uses
    `from __future__ import annotations`: on Python < 3.12 the class sees `NotRequired[...]` as a
    string and counts the key as required. Resolving the hints with their wrappers fixes that.
    """
    required = set(spec.__required_keys__)  # type: ignore[attr-defined]
    for key, hint in typing.get_type_hints(spec, include_extras=True).items():
        origin = typing.get_origin(hint)
        if origin is typing.NotRequired:
            required.discard(key)
        elif origin is typing.Required:
            required.add(key)
    return required


class BatchedDataDict(dict, Generic[T_co]):
    """A dict of batch fields (tensors / lists) that all hold one entry per sample along dim 0.

    `T_co` is a `TypedDict` naming the keys (`BatchedDataDict[RolloutBatch]`); it is not enforced
    unless `validate(spec)` is called. See the module docstring for sharing semantics.

    Raises (on construction and on every write):
        ValueError: a key is not a str, a value is neither a tensor with >= 1 dim nor a list, or
            the fields differ in length along dim 0.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.update(*args, **kwargs)

    # ----------------------------------------------------------------- writes (all validated)

    def __setitem__(self, key: str, value: BatchField) -> None:
        _check_field(key, value)
        others = {k: v for k, v in self.items() if k != key}
        if others:
            _check_equal_lengths({**others, key: value}, f"setting field {key!r}")
        super().__setitem__(key, value)

    def update(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        """Like `dict.update`; the merged result is validated as a whole before any write."""
        incoming = dict(*args, **kwargs)
        for key, value in incoming.items():
            _check_field(key, value)
        merged = {**self, **incoming}
        _check_equal_lengths(merged, "BatchedDataDict")
        super().update(incoming)

    def setdefault(self, key: str, default: BatchField | None = None) -> BatchField:
        if key not in self:
            self[key] = default  # type: ignore[assignment]
        return self[key]

    def __or__(self, other: Any) -> BatchedDataDict[T_co]:
        if not isinstance(other, Mapping):
            return NotImplemented
        return type(self)({**self, **other})

    def __ior__(self, other: Any) -> BatchedDataDict[T_co]:
        self.update(other)
        return self

    # ----------------------------------------------------------------------------- queries

    @property
    def batch_size(self) -> int:
        """Number of samples (the common dim-0 length of every field).

        Raises:
            ValueError: the batch has no fields (its size is undefined), or fields are ragged
                (possible only if a field's tensor/list was resized in place).
        """
        if not self:
            raise ValueError(
                "BatchedDataDict has no fields, so it has no batch size; add at "
                "least one field first"
            )
        _check_equal_lengths(self, "BatchedDataDict")
        return _field_len(next(iter(self.values())))

    def validate(self, spec: type, allow_extra_keys: bool = True) -> BatchedDataDict[T_co]:
        """Checks this batch against a `TypedDict` spec; returns self for chaining.

        Checks that every required key of `spec` is present, that fields annotated
        `torch.Tensor` / `list[...]` (or unions of them) have that type, and, with
        `allow_extra_keys=False`, that no key outside the spec is present.

        Raises:
            ValueError: `spec` is not a TypedDict, or the batch does not match it (the message
                lists every missing / mistyped / extra key).
        """
        if not typing.is_typeddict(spec):
            raise ValueError(
                f"validate expects a TypedDict class, got {spec!r}; declare the "
                f"batch's keys with `class MySpec(TypedDict): ...`"
            )
        problems = []
        missing = sorted(k for k in _required_keys(spec) if k not in self)
        if missing:
            problems.append(f"missing required key(s) {missing}")
        hints = typing.get_type_hints(spec)
        for key, annotation in hints.items():
            kinds = _annotation_kinds(annotation)
            if key in self and kinds is not None and not isinstance(self[key], tuple(kinds)):
                expected = " or ".join(sorted(k.__name__ for k in kinds))
                problems.append(f"field {key!r} should be {expected} but is {_describe(self[key])}")
        if not allow_extra_keys:
            extra = sorted(set(self) - set(hints))
            if extra:
                problems.append(f"key(s) {extra} are not in the spec")
        if problems:
            raise ValueError(
                f"batch does not match {spec.__name__}: {'; '.join(problems)} "
                f"(present keys: {sorted(self)})"
            )
        return self

    # -------------------------------------------------------------------------- selection

    def _map(self, fn_tensor: Any, fn_list: Any) -> BatchedDataDict[T_co]:
        """A new batch with every field transformed by the function for its kind."""
        return type(self)(
            {
                key: fn_tensor(value) if isinstance(value, torch.Tensor) else fn_list(value)
                for key, value in self.items()
            }
        )

    def slice(self, start: int, end: int) -> BatchedDataDict[T_co]:
        """Samples `[start, end)`; tensors are views of the receiver's storage.

        Raises:
            ValueError: not `0 <= start <= end <= batch_size` (negative indices are rejected
                rather than wrapped, so an off-by-one cannot silently take the batch's tail).
        """
        batch_size = self.batch_size
        if (
            isinstance(start, bool)
            or isinstance(end, bool)
            or not isinstance(start, int)
            or not isinstance(end, int)
            or not 0 <= start <= end <= batch_size
        ):
            raise ValueError(
                f"slice({start!r}, {end!r}) is out of range for a batch of "
                f"{batch_size} samples; need ints with 0 <= start <= end <= "
                f"{batch_size}"
            )
        return self._map(lambda t: t[start:end], lambda lst: lst[start:end])

    def select_indices(self, indices: Sequence[int] | torch.Tensor) -> BatchedDataDict[T_co]:
        """The samples at `indices`, in that order (repeats allowed); tensors are new copies.

        Args:
            indices: a sequence of ints or a 1-D integer tensor of positions in
                `[0, batch_size)`, or a 1-D bool tensor of length batch_size (a mask).

        Raises:
            ValueError: indices that are not 1-D integers / a matching mask, or out of range
                (negative indices are rejected, not wrapped).
        """
        batch_size = self.batch_size
        if isinstance(indices, torch.Tensor):
            if indices.dim() != 1:
                raise ValueError(
                    f"select_indices needs 1-D indices, got a tensor of shape "
                    f"{tuple(indices.shape)}"
                )
            if indices.dtype == torch.bool:
                if indices.shape[0] != batch_size:
                    raise ValueError(
                        f"select_indices: bool mask has length {indices.shape[0]} "
                        f"but the batch has {batch_size} samples"
                    )
                indices = indices.nonzero().flatten()
            elif indices.dtype.is_floating_point or indices.dtype.is_complex:
                raise ValueError(
                    f"select_indices needs integer indices, got dtype "
                    f"{indices.dtype}; convert with .long()"
                )
            index_list = [int(i) for i in indices.tolist()]
        else:
            index_list = list(indices)
            for i in index_list:
                if isinstance(i, bool) or not isinstance(i, int):
                    raise ValueError(
                        f"select_indices needs integer indices, got {i!r} ({type(i).__name__})"
                    )
        bad = [i for i in index_list if not 0 <= i < batch_size]
        if bad:
            raise ValueError(
                f"select_indices: index {bad[0]} is out of range for a batch of "
                f"{batch_size} samples (valid: 0..{batch_size - 1})"
            )
        index_cpu = torch.tensor(index_list, dtype=torch.int64)
        return self._map(
            lambda t: t.index_select(0, index_cpu.to(t.device)),
            lambda lst: [lst[i] for i in index_list],
        )

    def select_keys(self, keys: Iterable[str]) -> BatchedDataDict[Any]:
        """A batch holding only `keys` (same field objects, in the given order).

        Raises:
            ValueError: a key is not present (the message lists the present ones).
        """
        keys = list(keys)
        missing = [k for k in keys if k not in self]
        if missing:
            raise ValueError(
                f"select_keys: key(s) {missing} not in the batch; present keys: {sorted(self)}"
            )
        return BatchedDataDict({k: self[k] for k in keys})

    # --------------------------------------------------------------------------- sharding

    def _lengths(self, length_key: str, caller: str) -> list[int]:
        """Per-sample lengths from field `length_key` (1-D ints, >= 0)."""
        if length_key not in self:
            raise ValueError(
                f"{caller}: length key {length_key!r} is not in the batch (present "
                f"keys: {sorted(self)}); store per-sample token counts under it, "
                f"e.g. the lengths returned by pad_sequences"
            )
        value = self[length_key]
        if isinstance(value, torch.Tensor):
            if (
                value.dim() != 1
                or value.dtype.is_floating_point
                or value.dtype.is_complex
                or value.dtype == torch.bool
            ):
                raise ValueError(
                    f"{caller}: field {length_key!r} must be a 1-D integer tensor "
                    f"of per-sample lengths, got {_describe(value)}"
                )
            lengths = [int(n) for n in value.tolist()]
        else:
            if not all(isinstance(n, int) and not isinstance(n, bool) for n in value):
                raise ValueError(
                    f"{caller}: field {length_key!r} must hold int lengths, got {value!r}"
                )
            lengths = list(value)
        if any(n < 0 for n in lengths):
            raise ValueError(
                f"{caller}: field {length_key!r} has negative lengths "
                f"{sorted(n for n in lengths if n < 0)}"
            )
        return lengths

    def shard_by_batch_size(
        self, num_shards: int, *, balance_by: str | None = None
    ) -> ShardedBatch[T_co]:
        """Splits the batch into `num_shards` equally sized data-parallel shards.

        Without `balance_by`, shard r gets the r-th contiguous block of batch_size / num_shards
        samples (views, no copy). With `balance_by` (a key of per-sample lengths, e.g.
        "input_lengths"), every shard gets the same number of samples and shard totals of tokens
        are as equal as greedy longest-first bin-packing makes them: samples are taken longest
        first and each goes to the non-full shard with the fewest tokens so far (ties: lowest
        shard index). Within a shard, samples keep their original relative order.

        Returns:
            A `ShardedBatch`: `.shards[r]` and `.shard_indices[r]` (the original position of
            each of shard r's samples); `unshard(results)` puts per-shard results back in the
            original order.

        Raises:
            ValueError: `num_shards` not a positive int, a batch size it does not divide (the
                message names the numbers and the fix), or a bad `balance_by` field.
        """
        _check_positive_int(num_shards, "num_shards", "pass the data-parallel world size")
        total = self.batch_size
        if total % num_shards != 0:
            raise ValueError(
                f"cannot split {total} samples into {num_shards} equal shards: {total} is not a "
                f"multiple of num_shards={num_shards}; pad the batch to a multiple of "
                f"{num_shards} samples first (the GRPO loop pads with masked copies of a "
                f"sample: algorithms/rollouts.py, pad_to_dp_multiple)"
            )
        per_shard = total // num_shards
        if balance_by is None:
            shard_indices = [
                list(range(r * per_shard, (r + 1) * per_shard)) for r in range(num_shards)
            ]
            shards = [self.slice(r * per_shard, (r + 1) * per_shard) for r in range(num_shards)]
        else:
            shard_indices = _balance(self._lengths(balance_by, "shard_by_batch_size"), num_shards)
            shards = [self.select_indices(indices) for indices in shard_indices]
        return ShardedBatch(shards=shards, shard_indices=shard_indices)

    # --------------------------------------------------------------------------- padding

    @classmethod
    def from_sequences(
        cls,
        sequences: Mapping[str, Sequence[torch.Tensor | Sequence[int]]],
        pad_values: Mapping[str, float | int] | None = None,
        lengths_key: str | None = None,
    ) -> BatchedDataDict[Any]:
        """A batch of `[B, S]` fields, each right-padded from B variable-length 1-D sequences.

        Typical use: generation outputs, `from_sequences({"output_ids": ids, "logprobs": lps},
        pad_values={"output_ids": pad_token_id}, lengths_key="output_lengths")`.

        Args:
            sequences: field name -> B sequences (see `pad_sequences`). Each field is padded to
                its own longest sequence.
            pad_values: field name -> pad value (default 0).
            lengths_key: if given, the per-sample lengths are stored under this key as an int64
                `[B]` tensor; every field must then have the same length for each sample.

        Raises:
            ValueError: as `pad_sequences`; fields with different numbers of samples;
                `pad_values` naming absent fields; `lengths_key` colliding with a field or
                fields whose per-sample lengths differ.
        """
        if not sequences:
            raise ValueError("from_sequences needs at least one field of sequences")
        pad_values = dict(pad_values or {})
        unknown = sorted(set(pad_values) - set(sequences))
        if unknown:
            raise ValueError(
                f"from_sequences: pad_values has key(s) {unknown} that are not "
                f"fields; fields: {sorted(sequences)}"
            )
        if lengths_key is not None and lengths_key in sequences:
            raise ValueError(
                f"from_sequences: lengths_key {lengths_key!r} is also a field name; "
                f"choose another lengths_key"
            )
        fields: dict[str, BatchField] = {}
        lengths: dict[str, torch.Tensor] = {}
        for key, seqs in sequences.items():
            try:
                fields[key], lengths[key] = pad_sequences(seqs, pad_values.get(key, 0))
            except ValueError as error:
                raise ValueError(f"from_sequences: field {key!r}: {error}") from None
        _check_equal_lengths(fields, "from_sequences")
        if lengths_key is not None:
            first_key = next(iter(lengths))
            for key, lengths_B in lengths.items():
                differ = (lengths_B.cpu() != lengths[first_key].cpu()).nonzero().flatten()
                if differ.numel():
                    b = int(differ[0])
                    raise ValueError(
                        f"from_sequences: sample {b} has length "
                        f"{int(lengths_B[b])} in field {key!r} but "
                        f"{int(lengths[first_key][b])} in {first_key!r}; with "
                        f"lengths_key every field needs the same per-sample length "
                        f"(build the batch without lengths_key, or fix the fields)"
                    )
            fields[lengths_key] = lengths[first_key]
        return cls(fields)

    # ----------------------------------------------------------------------- microbatches

    def make_microbatch_iterator(
        self, microbatch_size: int, allow_partial: bool = False
    ) -> Iterator[BatchedDataDict[T_co]]:
        """Consecutive microbatches of `microbatch_size` samples covering the batch in order.

        By default the batch size must be a multiple of `microbatch_size`, so every
        microbatch has the same shape (gradient accumulation then weighs them equally);
        `allow_partial=True` lets the last microbatch be smaller instead. Checked when called,
        not on first iteration. Microbatches are views (see `slice`).

        Raises:
            ValueError: `microbatch_size` is not a positive int, or the sizes do not divide and
                `allow_partial` is False.
        """
        _check_positive_int(
            microbatch_size,
            "microbatch_size",
            "pass the number of samples per forward/backward pass",
        )
        batch_size = self.batch_size
        if not allow_partial and batch_size % microbatch_size != 0:
            raise ValueError(
                f"batch of {batch_size} samples is not a multiple of "
                f"microbatch_size={microbatch_size}; pad the batch to a multiple of "
                f"{microbatch_size} first, or pass allow_partial=True to make the last "
                f"microbatch smaller"
            )
        bounds = [
            (start, min(start + microbatch_size, batch_size))
            for start in range(0, batch_size, microbatch_size)
        ]
        return (self.slice(start, end) for start, end in bounds)

    # --------------------------------------------------------------------- concatenation

    @classmethod
    def concat(
        cls,
        batches: Sequence[Mapping[str, BatchField]],
        pad_values: Mapping[str, float | int] | None = None,
    ) -> BatchedDataDict[Any]:
        """Concatenates batches along dim 0.

        Every batch must have the same keys, the same kind (tensor/list) per key, and for
        tensors the same dtype, device, number of dims and trailing dims. Dim 1 may differ only
        for keys in `pad_values`: those tensors are right-padded along dim 1 to the longest
        with `pad_values[key]` (e.g. sequences generated with different max lengths).

        Raises:
            ValueError: no batches, ragged batches, or a mismatch (the message names the key,
                the batch indices and their shapes, and the fix).
        """
        batches = [b if isinstance(b, BatchedDataDict) else BatchedDataDict(b) for b in batches]
        if not batches:
            raise ValueError("concat needs at least one batch")
        keys = list(batches[0])
        for index, batch in enumerate(batches):
            if set(batch) != set(keys):
                raise ValueError(
                    f"concat: batch {index} has keys {sorted(batch)} but batch 0 "
                    f"has {sorted(keys)} (missing: {sorted(set(keys) - set(batch))},"
                    f" extra: {sorted(set(batch) - set(keys))}); use select_keys "
                    f"to keep the common keys"
                )
            batch.batch_size  # noqa: B018 - raises on ragged batches before combining them
        pad_values = dict(pad_values or {})
        unknown = sorted(set(pad_values) - set(keys))
        if unknown:
            raise ValueError(
                f"concat: pad_values has key(s) {unknown} that are not in the "
                f"batches; keys: {sorted(keys)}"
            )
        return cls({key: _concat_field(key, [b[key] for b in batches], pad_values) for key in keys})

    # ----------------------------------------------------------------- whole-batch transforms

    def to(self, *args: Any, **kwargs: Any) -> BatchedDataDict[T_co]:
        """Tensors moved with `tensor.to(*args, **kwargs)` (device and/or dtype); lists as-is.

        Note a dtype argument converts every tensor, ids included: pass only a device unless
        that is what you want.
        """
        return self._map(lambda t: t.to(*args, **kwargs), lambda lst: lst)

    def copy(self) -> BatchedDataDict[T_co]:
        """A shallow copy: a new dict holding the same tensor and list objects."""
        return type(self)(self)


def _concat_field(key: str, values: list[BatchField], pad_values: Mapping[str, Any]) -> BatchField:
    kinds = {isinstance(v, torch.Tensor) for v in values}
    if len(kinds) > 1:
        described = ", ".join(f"batch {i}: {_describe(v)}" for i, v in enumerate(values))
        raise ValueError(
            f"concat: field {key!r} is a tensor in some batches and a list in "
            f"others ({described}); make it one kind everywhere"
        )
    if isinstance(values[0], list):
        return [x for value in values for x in value]
    first = values[0]
    for index, value in enumerate(values[1:], start=1):
        if value.dtype != first.dtype or value.device != first.device:
            raise ValueError(
                f"concat: field {key!r} is {value.dtype} on {value.device} in batch "
                f"{index} but {first.dtype} on {first.device} in batch 0; convert "
                f"with .to(...) first"
            )
        if (
            value.dim() != first.dim()
            or value.shape[2:] != first.shape[2:]
            or (value.shape[1:2] != first.shape[1:2] and key not in pad_values)
        ):
            fix = (
                f"pass pad_values={{{key!r}: <pad value>}} to right-pad dim 1 to the longest"
                if value.dim() == first.dim()
                and value.dim() >= 2
                and value.shape[2:] == first.shape[2:]
                else "only dim 1 may differ, and only with pad_values"
            )
            raise ValueError(
                f"concat: field {key!r} has shape {tuple(first.shape)} in batch 0 "
                f"but {tuple(value.shape)} in batch {index}; {fix}"
            )
    if key in pad_values and first.dim() >= 2:
        width = max(v.shape[1] for v in values)
        padded = []
        for value in values:
            if value.shape[1] < width:
                padding = torch.full(
                    (value.shape[0], width - value.shape[1], *value.shape[2:]),
                    pad_values[key],
                    dtype=value.dtype,
                    device=value.device,
                )
                value = torch.cat([value, padding], dim=1)
            padded.append(value)
        values = padded
    return torch.cat(values, dim=0)


def _balance(lengths: Sequence[int], num_shards: int) -> list[list[int]]:
    """Assigns positions of `lengths` to `num_shards` equally sized shards, balancing totals.

    Greedy longest-first: positions sorted by length (descending; ties by position, for
    determinism) each go to the non-full shard with the smallest total (ties by shard index).
    Returns each shard's positions in ascending order.
    """
    assert len(lengths) % num_shards == 0, (len(lengths), num_shards)
    capacity = len(lengths) // num_shards
    # A min-heap of (total tokens, shard) over shards that still have room: full shards leave it.
    heap = [(0, shard) for shard in range(num_shards)]
    members: list[list[int]] = [[] for _ in range(num_shards)]
    for position in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        total, shard = heapq.heappop(heap)
        members[shard].append(position)
        if len(members[shard]) < capacity:
            heapq.heappush(heap, (total + lengths[position], shard))
    return [sorted(m) for m in members]


@dataclasses.dataclass(frozen=True)
class ShardedBatch(Generic[T_co]):
    """The result of `BatchedDataDict.shard_by_batch_size`.

    Attributes:
        shards: one batch per data-parallel rank.
        shard_indices: `shard_indices[r][i]` is the original position of `shards[r]`'s sample i.
    """

    shards: list[BatchedDataDict[T_co]]
    shard_indices: list[list[int]]

    @property
    def permutation(self) -> list[int]:
        """Original positions of the shards' samples concatenated in shard order."""
        return [i for indices in self.shard_indices for i in indices]

    def unshard(
        self,
        results: Sequence[Mapping[str, BatchField]],
        pad_values: Mapping[str, float | int] | None = None,
    ) -> BatchedDataDict[Any]:
        """Concatenates per-shard results and restores the original sample order.

        Args:
            results: `results[r]` is computed from `shards[r]`, one row per sample in the same
                order (its keys may differ from the inputs', e.g. log-probs).
            pad_values: passed to `concat` (shards may return different sequence widths).

        Raises:
            ValueError: the wrong number of results, or a result whose batch size differs from
                its shard's.
        """
        if len(results) != len(self.shards):
            raise ValueError(
                f"unshard: got {len(results)} results for {len(self.shards)} "
                f"shards; pass one result per shard, in shard order"
            )
        results = [r if isinstance(r, BatchedDataDict) else BatchedDataDict(r) for r in results]
        for shard, (result, indices) in enumerate(zip(results, self.shard_indices)):
            if result.batch_size != len(indices):
                raise ValueError(
                    f"unshard: result {shard} has {result.batch_size} samples but "
                    f"shard {shard} had {len(indices)}; each result needs one row "
                    f"per sample of its shard"
                )
        combined = BatchedDataDict.concat(results, pad_values=pad_values)
        return combined.select_indices(invert_permutation(self.permutation))
