"""deltalab.models.replay: which sequences and chunks an edit of `hook_state` runs again, and what it leaves alone."""

from __future__ import annotations

import pytest
import torch

from deltalab.models.replay import check_state_shape, replay_patched


def test_each_patched_sequence_restarts_at_its_own_first_patch_and_the_rest_stay_bit_for_bit():
    B, NC, T = 3, 4, 230  # chunks of 64: the last one holds 38 tokens
    clean = torch.randn(B, NC + 1, 2, 4, 4)
    hooked = clean.clone()
    hooked[0, 2] += 1.0  # sequence 0 from chunk 2
    hooked[2, 1, 0, 0, 0] = 7.0  # sequence 2 from chunk 1 (one entry)
    hooked[1, NC] = 0.0  # the final state of sequence 1 feeds no output
    o = torch.randn(B, T, 2, 4)
    calls = []

    def step(rows, t, state):
        calls.append((rows.tolist(), t.start, t.stop, state[:, 0, 0, 0].tolist()))
        return torch.full((len(rows), t.stop - t.start, 2, 4), float(t.start)), state + 1.0

    out = replay_patched(o, clean, hooked, T, step)
    assert [c[:3] for c in calls] == [([2], 64, 128), ([2], 128, 192), ([2], 192, 230),
                                      ([0], 128, 192), ([0], 192, 230)]  # fmt: skip
    assert calls[0][3] == [7.0]  # the patched state starts the replay
    assert calls[1][3] == [8.0]  # unpatched later chunk starts carry the replayed state
    assert calls[3][3] == [float(hooked[0, 2, 0, 0, 0])]
    assert torch.equal(out[1], o[1]) and torch.equal(out[0, :128], o[0, :128]) and torch.equal(out[2, :64], o[2, :64])
    assert torch.equal(out[0, 128:192], torch.full((64, 2, 4), 128.0))
    assert torch.equal(out[2, 192:], torch.full((38, 2, 4), 192.0))


def test_no_patch_returns_the_outputs_unchanged():
    clean = torch.randn(2, 3, 1, 2, 2)
    o = torch.randn(2, 100, 1, 2)
    assert replay_patched(o, clean, clean.clone(), 100, lambda *a: pytest.fail("nothing to replay")) is o


def test_a_state_of_another_shape_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"hook_state must keep its shape \(2, 3\), got \(2, 4\)"):
        check_state_shape(torch.zeros(2, 3), torch.zeros(2, 4))
