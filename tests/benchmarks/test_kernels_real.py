"""The real-model rows' helpers of `benchmarks.kernels` (the timings themselves need a GPU)."""

from __future__ import annotations

from benchmarks.kernels import mixed_lengths, real_floors


def test_mixed_lengths_are_deterministic_documents_summing_to_the_total():
    a, b = mixed_lengths(32768), mixed_lengths(32768)
    assert a == b and sum(a) == 32768 and len(a) > 8
    assert min(a) >= 1 and max(a) <= 8192
    assert sum(n % 64 == 0 for n in a) < len(a) // 4  # mostly partial last chunks


def test_real_floors_count_grouped_heads_and_per_sequence_states():
    dense = real_floors([4096], 16, 32, 128, 128, 1)
    packed = real_floors([4000, 96], 16, 32, 128, 128, 1)
    assert packed[0] > dense[0]  # two sequences: one more final state and one more partial chunk boundary
    wider_keys = real_floors([4096], 32, 32, 128, 128, 1)
    assert wider_keys[0] > dense[0] and wider_keys[1] == dense[1]  # q, k read per key head; FLOPs per value head
