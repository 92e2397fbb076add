"""Actor bodies and batch builders for the data plane's tests and benchmark (not library code).

`ExperienceProducer` plays the generation side and `ExperienceTrainer` the trainer side. They
are plain classes in an importable module so Ray workers import them by name; wrap them with
`ray.remote(**data_plane_actor_options())(ExperienceProducer)`.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import torch

from dockyard_rl.data_plane.interfaces import DataPlaneError
from dockyard_rl.distributed.batched_data_dict import BatchedDataDict

# The pattern batches' ids encode (producer index, batch number) so a receiver can check that
# what arrived under (producer, seq) is that batch.
PATTERN_STRIDE = 1_000_000


def pattern_batch(
    producer_index: int, number: int, batch_size: int, seq_len: int
) -> BatchedDataDict:
    """Small batch whose every id is producer_index * PATTERN_STRIDE + number."""
    value = producer_index * PATTERN_STRIDE + number
    return BatchedDataDict(
        input_ids_BS=torch.full((batch_size, seq_len), value, dtype=torch.int64),
        logprobs_BS=torch.full((batch_size, seq_len), -float(number), dtype=torch.float32),
        mask_BS=torch.ones((batch_size, seq_len), dtype=torch.bool),
        instance_ids=[f"p{producer_index}-b{number}-s{i}" for i in range(batch_size)],
    )


def random_experience_batch(seed: int, batch_size: int, seq_len: int) -> BatchedDataDict:
    """Experience with arbitrary bit patterns: full-range int64 ids, float32 log-probs drawn as
    raw 32-bit words (NaN payloads, infinities, denormals, -0.0 included), bool and float masks,
    float32 rewards, a non-contiguous field and a list field."""
    generator = torch.Generator().manual_seed(seed)
    shape = (batch_size, seq_len)
    ids_BS = torch.randint(-(2**63), 2**63 - 1, shape, dtype=torch.int64, generator=generator)
    logprob_bits_BS = torch.randint(
        -(2**31), 2**31 - 1, shape, dtype=torch.int32, generator=generator
    )
    return BatchedDataDict(
        input_ids_BS=ids_BS,
        logprobs_BS=logprob_bits_BS.view(torch.float32),
        token_mask_BS=torch.rand(shape, generator=generator) < 0.7,
        loss_mask_BS=(torch.rand(shape, generator=generator) < 0.5).to(torch.float32),
        rewards_B=torch.randn((batch_size,), generator=generator),
        # A transposed view: not contiguous on the producer (collective transports copy it).
        ref_logprobs_BS=torch.randn((seq_len, batch_size), generator=generator).t(),
        instance_ids=[f"instance-{seed}-{i}" for i in range(batch_size)],
    )


def ids_and_logprobs_batch(batch_size: int, seq_len: int) -> BatchedDataDict:
    """The benchmark's batch: int64 token ids + float32 log-probs."""
    generator = torch.Generator().manual_seed(0)
    return BatchedDataDict(
        input_ids_BS=torch.randint(
            0, 50_000, (batch_size, seq_len), dtype=torch.int64, generator=generator
        ),
        logprobs_BS=-torch.rand((batch_size, seq_len), generator=generator) * 10,
    )


def batch_digest(batch: BatchedDataDict) -> str:
    """SHA-256 over every field's name, dtype, shape and raw bytes (lists as their repr)."""
    digest = hashlib.sha256()
    for name, value in batch.items():
        digest.update(name.encode())
        if isinstance(value, torch.Tensor):
            flat = value.detach().cpu().contiguous().reshape(-1)
            digest.update(f"{value.dtype}{tuple(value.shape)}".encode())
            digest.update(flat.view(torch.uint8).numpy().tobytes())
        else:
            digest.update(repr(value).encode())
    return digest.hexdigest()


def _error_name(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


class ExperienceProducer:
    """The generation side: opens its sender, sends batches."""

    def __init__(self, index: int = 0):
        self._index = index
        self._sender = None
        self._cached: BatchedDataDict | None = None

    def open(self, spec: Any) -> tuple[str, int]:
        self._sender = spec.open()
        assert spec.open() is self._sender  # idempotent per process
        return self._sender.producer_id, self._sender.next_seq

    def send_patterns(
        self, num_batches: int, batch_size: int, seq_len: int, resend_each: bool = False
    ) -> list[tuple[int, str | None]]:
        """Sends pattern batches numbered next_seq, next_seq + 1, ...; optionally resends each
        right away (a duplicate). Returns (seq, resend status or None) per batch."""
        results = []
        for _ in range(num_batches):
            number = self._sender.next_seq
            seq = self._sender.send(
                pattern_batch(self._index, number, batch_size, seq_len),
                {"number": number, "producer_index": self._index},
            )
            status = self._sender.resend().value if resend_each else None
            results.append((seq, status))
        return results

    def send_random(self, seed: int, batch_size: int, seq_len: int) -> tuple[int, str]:
        batch = random_experience_batch(seed, batch_size, seq_len)
        seq = self._sender.send(batch, {"seed": seed, "weight_version": 7})
        return seq, batch_digest(batch)

    def try_send(self, batch_size: int, seq_len: int, timeout_s: float) -> tuple[Any, float]:
        """(seq or 'ErrorType: message', seconds waited)."""
        start = time.monotonic()
        number = self._sender.next_seq
        try:
            result: Any = self._sender.send(
                pattern_batch(self._index, number, batch_size, seq_len),
                {"number": number},
                timeout_s=timeout_s,
            )
        except DataPlaneError as error:
            result = _error_name(error)
        return result, time.monotonic() - start

    def resend(self) -> str:
        try:
            return self._sender.resend().value
        except DataPlaneError as error:
            return _error_name(error)

    def transfer_last_again(self) -> str:
        """White-box: retransmits the last batch's tensors WITHOUT asking for a slot first, as a
        retry racing its own original would; returns the receiver's verdict."""
        seq, packed = self._sender._last
        return self._sender._transfer(seq, packed).verdict.value

    def skip_seq(self) -> int:
        """White-box: loses one seq on the sender side (as a sender restored from a stale
        checkpoint would); the next send must be rejected as a gap."""
        self._sender._next_seq += 1
        return self._sender._next_seq

    def cache_batch(self, batch_size: int, seq_len: int) -> None:
        self._cached = ids_and_logprobs_batch(batch_size, seq_len)

    def send_cached(self, num_batches: int = 1) -> int:
        """Sends the cached batch `num_batches` times; returns the last seq."""
        for _ in range(num_batches):
            seq = self._sender.send(self._cached)
        return seq

    def return_cached(self) -> BatchedDataDict:
        """The object-store baseline: the batch as a task result."""
        return self._cached


class StepProducer:
    """Async GRPO's collector in miniature: one sender per trainer rank, a step's batch sent with
    `experience.send_step_shards` (returns the RemoteBatch handle)."""

    def open(self, specs: Any) -> None:
        self._senders = [spec.open() for spec in specs]

    def send_step(self, batch: BatchedDataDict, step: int) -> Any:
        from dockyard_rl.data_plane.experience import send_step_shards
        from dockyard_rl.losses.loss_functions import count_valid

        return send_step_shards(self._senders, batch, step=step, num_valid=count_valid(batch))


class ExperienceTrainer:
    """The trainer side: opens its receiver and receives on its main thread, like a training
    loop would, while deliveries arrive on the data-plane threads."""

    def __init__(self):
        self._receiver = None

    def open(self, spec: Any) -> None:
        self._receiver = spec.open()
        assert spec.open() is self._receiver

    def receive(
        self, num_batches: int, timeout_s: float | None = None, pause_s: float = 0.0
    ) -> list[dict[str, Any]]:
        """Receives `num_batches` (sleeping `pause_s` before each, a slow trainer) and returns
        one summary per delivery."""
        summaries = []
        for _ in range(num_batches):
            if pause_s:
                time.sleep(pause_s)
            delivery = self._receiver.receive(timeout_s)
            batch = delivery.batch
            summaries.append(
                {
                    "producer_id": delivery.producer_id,
                    "seq": delivery.seq,
                    "metadata": delivery.metadata,
                    "digest": batch_digest(batch),
                    "fields": {
                        k: (str(v.dtype), tuple(v.shape))
                        if isinstance(v, torch.Tensor)
                        else ("list", len(v))
                        for k, v in batch.items()
                    },
                    "first_id": int(batch["input_ids_BS"].reshape(-1)[0]),
                    "lists": {k: v for k, v in batch.items() if isinstance(v, list)},
                }
            )
        return summaries

    def try_receive(self, timeout_s: float) -> str:
        try:
            delivery = self._receiver.receive(timeout_s)
        except DataPlaneError as error:
            return _error_name(error)
        return f"{delivery.producer_id}/{delivery.seq}"

    def receive_count(self, num_batches: int = 1) -> int:
        """Receives `num_batches`; returns their tensor bytes (the benchmark's consumer)."""
        return sum(self.take_batch(self._receiver.receive().batch) for _ in range(num_batches))

    def take_batch(self, batch: BatchedDataDict) -> int:
        """The object-store baseline's consumer: the batch as a task argument."""
        return sum(
            v.numel() * v.element_size() for v in batch.values() if isinstance(v, torch.Tensor)
        )

    def stats(self) -> dict[str, Any]:
        return self._receiver.stats()
