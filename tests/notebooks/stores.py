"""Checkpoints and stores the notebook tests run against, built once per pytest run.

- `planted_s4_checkpoint`: a 1-layer DeltaProduct_2[-1, 1] over the S4 vocabulary whose head 0 is the S4
  rotation head by construction: beta = 2 on both steps and, for every group element, two keys in a 3-D
  subspace whose reflections multiply to that element's rotation of the cube (the planes meet at half the
  rotation angle). Head 1 is random (beta ~ 1). The notebook must recover head 0 and the cube's angles.
- `random_s4_checkpoint`: the same shape with random weights (no reflection head).
- `tiny_lm_checkpoint`: a random byte-level LM (vocab 257, tokenizer.json, train_config.json) standing in
  for the state-reduction helper's stdlib LM.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np

TRAIN_LENGTH = 32
"""Training length recorded beside the S4 test checkpoints (the default store captures twice this)."""


def cube_rotations() -> dict[tuple[int, ...], np.ndarray]:
    """The 24 rotations of the cube keyed by the permutation they induce on its 4 body diagonals."""
    diagonals = np.array([[1, 1, 1], [1, 1, -1], [1, -1, 1], [-1, 1, 1]], dtype=float)
    out = {}
    for perm in itertools.permutations(range(3)):
        for signs in itertools.product((1, -1), repeat=3):
            rot = np.zeros((3, 3))
            rot[np.arange(3), perm] = signs
            if np.linalg.det(rot) < 0:
                continue
            images = rot @ diagonals.T  # [3, 4]
            key = tuple(int(np.flatnonzero(np.isclose(np.abs(diagonals @ images[:, i]), 3.0))[0]) for i in range(4))
            out[key] = rot
    return out


def reflection_pair(rot: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unit k1, k2 in R^3 with (I - 2 k2 k2^T)(I - 2 k1 k1^T) = rot (two reflections make a rotation)."""
    def house(k: np.ndarray) -> np.ndarray:
        return np.eye(3) - 2 * np.outer(k, k)

    angle = np.arccos(np.clip((np.trace(rot) - 1) / 2, -1, 1))
    if angle < 1e-9:
        k = np.array([1.0, 0.0, 0.0])
        return k, k
    w, vecs = np.linalg.eig(rot)
    axis = np.real(vecs[:, np.argmin(np.abs(w - 1))])
    axis /= np.linalg.norm(axis)
    k1 = np.cross(axis, [1.0, 0.0, 0.0] if abs(axis[0]) < 0.9 else [0.0, 1.0, 0.0])
    k1 /= np.linalg.norm(k1)
    for half in (angle / 2, -angle / 2):  # the sign that turns the right way
        k2 = np.cos(half) * k1 + np.sin(half) * np.cross(axis, k1)
        if np.allclose(house(k2) @ house(k1), rot, atol=1e-9):
            return k1, k2
    raise AssertionError("no reflection pair found")  # cannot happen for a rotation


def silu_inverse(y: np.ndarray) -> np.ndarray:
    """z >= -1.278 (silu's increasing branch) with silu(z) = y, for y > -0.2784, by bisection."""
    lo, hi = np.full_like(y, -1.2784645), np.maximum(y, 0.0) + 1.0
    for _ in range(80):
        mid = (lo + hi) / 2
        low = mid / (1 + np.exp(-mid)) < y
        lo, hi = np.where(low, mid, lo), np.where(low, hi, mid)
    return (lo + hi) / 2


def _s4_config():
    from deltalab.models import ModelConfig

    return ModelConfig(model_type="gated_deltaproduct", vocab_size=24, hidden_size=32, num_hidden_layers=1,
                       num_heads=2, head_dim=8, expand_v=1.0, num_householder=2, use_forget_gate=False,
                       use_output_gate=False, use_short_conv=False, allow_neg_eigval=True)


def planted_s4_checkpoint(folder: Path) -> Path:
    """See the module docstring; returns `folder`."""
    import torch

    from deltalab.models import DeltaProductForCausalLM, save_checkpoint
    from deltalab.tasks.state_tracking import get_task

    torch.manual_seed(0)
    cfg = _s4_config()
    model = DeltaProductForCausalLM(cfg)
    group = get_task("S4").group
    rots = cube_rotations()
    H, n_h, dk, D = cfg.num_heads, cfg.num_householder, cfg.head_k_dim, cfg.hidden_size
    basis = np.linalg.qr(np.random.default_rng(0).normal(size=(dk, 3)))[0]  # the head's 3-D key subspace
    const = D - 1  # an embedding direction every token shares: drives beta to 2
    attn = model.layers[0].attn
    with torch.no_grad():
        emb = torch.zeros(cfg.vocab_size, D)
        emb[torch.arange(cfg.vocab_size), torch.arange(cfg.vocab_size)] = 1.0
        emb[:, const] = 1.0
        model.embeddings.weight.copy_(emb)
        scale = float(model.layers[0].attn_norm(emb[:1])[0, 0])  # the normalised one-hot entry
        k_w = attn.k_proj.weight.view(n_h, H, dk, D)
        for token, perm in enumerate(group.perms):
            for step, key in enumerate(reflection_pair(rots[tuple(int(p) for p in perm)])):
                # keys pass SiLU then L2 norm: pre-activations whose SiLU points along the planted key
                pre = silu_inverse(0.25 * (basis @ key)) / scale
                k_w[step, 0, :, token] = torch.from_numpy(pre).float()
        k_w[:, 0, :, const] = 0.0
        b_w = attn.b_proj.weight.view(n_h, H, D)
        b_w[:, 0] = 0.0
        b_w[:, 0, const] = 8.0  # sigmoid(8 * |x| / rms) ~ 1 - 1e-14: beta = 2
        b_w[:, 1] = 0.0  # head 1: beta = 1
    save_checkpoint(model, folder)
    (folder / "train.json").write_text(json.dumps({"train_length": TRAIN_LENGTH}))
    return folder


def random_s4_checkpoint(folder: Path) -> Path:
    """A random model of the planted one's shape (no reflection head)."""
    import torch

    from deltalab.models import DeltaProductForCausalLM, save_checkpoint

    torch.manual_seed(1)
    save_checkpoint(DeltaProductForCausalLM(_s4_config()), folder)
    (folder / "train.json").write_text(json.dumps({"train_length": TRAIN_LENGTH}))
    return folder


def tiny_lm_checkpoint(folder: Path, context_length: int = 64) -> Path:
    """A random 1-layer byte-level gated DeltaProduct LM with the files train_lm writes beside a checkpoint."""
    import torch

    from deltalab.models import DeltaProductForCausalLM, ModelConfig, save_checkpoint
    from deltalab.tasks.corpus import VOCAB_SIZE, write_tokenizer

    torch.manual_seed(2)
    cfg = ModelConfig(model_type="gated_deltaproduct", vocab_size=VOCAB_SIZE, hidden_size=32, num_hidden_layers=1,
                      num_heads=2, head_dim=16, expand_v=1.0, num_householder=2, use_forget_gate=True,
                      use_short_conv=True, allow_neg_eigval=True)
    save_checkpoint(DeltaProductForCausalLM(cfg), folder)
    write_tokenizer(folder)
    (folder / "train_config.json").write_text(json.dumps({"context_length": context_length, "steps": 0}))
    return folder
