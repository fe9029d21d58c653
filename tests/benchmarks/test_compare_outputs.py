"""`benchmarks.compare_outputs compare`: one line per point, exit 0 when every tensor matches bit for bit, 1 on any
difference (a flipped bit, a missing output, a changed shape), 2 with one line when a file cannot be read. The save
step needs CUDA (the Triton forwards) and runs on the GPU machine; its file layout is built here by hand."""

from __future__ import annotations

import hashlib

import torch
from safetensors.torch import save_file

from benchmarks.compare_outputs import _as_bytes, main


def _outputs(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "grid B=1 T=2048 n_h=1 gate=0 | o": torch.randn(2, 3, generator=gen).bfloat16(),
        "grid B=1 T=2048 n_h=1 gate=0 | final": torch.randn(4, generator=gen),
        "kda B=1 T=2048 H=16 | o": torch.randn(5, generator=gen),
    }


def test_identical_files_compare_equal(tmp_path, capsys):
    save_file(_outputs(), tmp_path / "a.safetensors")
    save_file(_outputs(), tmp_path / "b.safetensors")
    assert main(["compare", str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == ["same     grid B=1 T=2048 n_h=1 gate=0", "same     kda B=1 T=2048 H=16"]
    assert lines[-1] == "2 of 2 points bit-identical"


def test_one_flipped_bit_and_a_missing_output_are_differences(tmp_path, capsys):
    a, b = _outputs(), _outputs()
    bits = b["kda B=1 T=2048 H=16 | o"].view(torch.int32)
    bits[0] ^= 1  # the last mantissa bit of one element
    del b["grid B=1 T=2048 n_h=1 gate=0 | final"]
    save_file(a, tmp_path / "a.safetensors")
    save_file(b, tmp_path / "b.safetensors")
    assert main(["compare", str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")]) == 1
    out = capsys.readouterr().out
    assert "DIFFERS  grid B=1 T=2048 n_h=1 gate=0  (final only in" in out
    assert "DIFFERS  kda B=1 T=2048 H=16  (o: max |diff|" in out
    assert out.splitlines()[-1] == "0 of 2 points bit-identical"


def test_digests_compare_as_digests(tmp_path, capsys):
    def digests(outputs):
        return {k: torch.frombuffer(bytearray(hashlib.sha256(_as_bytes(v).numpy()).digest()), dtype=torch.uint8)
                for k, v in outputs.items()}  # fmt: skip

    save_file(digests(_outputs(0)), tmp_path / "a.safetensors")
    save_file(digests(_outputs(1)), tmp_path / "b.safetensors")
    assert main(["compare", str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")]) == 1
    assert "digests differ" in capsys.readouterr().out


def test_an_unreadable_file_is_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "a.safetensors").write_bytes(b"not a safetensors file")
    save_file(_outputs(), tmp_path / "b.safetensors")
    assert main(["compare", str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")]) == 2
    out = capsys.readouterr().out.strip()
    assert "\n" not in out and out.startswith(f"compare_outputs: cannot read {tmp_path / 'a.safetensors'}")


def test_save_without_cuda_or_into_a_folder_is_exit_2(tmp_path, capsys):
    assert main(["save", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().out
    if not torch.cuda.is_available():
        assert main(["save", str(tmp_path / "out.safetensors")]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().out
        assert not (tmp_path / "out.safetensors").exists()
