"""Warm-up covers every forward shape the engine can pick (the XLA zero-recompile guarantee rests
on this enumeration)."""

from __future__ import annotations

import pytest

from neuron_worker.scheduler import bucket_for, forward_shapes, pow2_buckets


@pytest.mark.parametrize(
    ("batch", "tokens", "seq", "max_seq"),
    [
        ([1, 2], [1, 8, 128], [128], 128),
        ([1, 2, 4, 8], [1, 16, 512], [128, 256, 512], 512),
        ([2], pow2_buckets(1, 256), pow2_buckets(64, 256), 256),
    ],
)
def test_every_reachable_shape_is_warmed(
    batch: list[int], tokens: list[int], seq: list[int], max_seq: int
) -> None:
    shapes = set(forward_shapes(batch, tokens, seq))
    assert len(shapes) == len(forward_shapes(batch, tokens, seq))  # no duplicates
    # ForwardBatch.pack: rows of k tokens written from `start`; T = token bucket of the longest row,
    # kv_len = sequence bucket of the furthest end.
    for n in batch:
        for k in range(1, max_seq + 1):
            for start in range(0, max_seq - k + 1):
                shape = (n, bucket_for(tokens, k), bucket_for(seq, start + k))
                assert shape in shapes, shape


def test_counts() -> None:
    assert len(forward_shapes([1, 2], [1, 8, 128], [128])) == 6  # batch x tokens x kv
    # A 2-token prompt pads to 256 tokens but attends 128 positions: T may exceed kv_len.
    assert forward_shapes([1], [1, 256], [128, 256]) == [
        (1, 1, 128),
        (1, 1, 256),
        (1, 256, 128),
        (1, 256, 256),
    ]
    # Rows of more than 128 tokens never fit kv_len 128.
    assert (1, 512, 128) not in forward_shapes([1], [1, 128, 512], [128, 512])
