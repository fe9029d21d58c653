"""Small stores with planted structure, so every probe has a known answer (tests, benchmarks, demos).

Planted in layer 0 (layer 1 and other heads are random):
- head 0 "rotation head": both Householder steps have beta = 2 and keys that depend only on the
  token and lie in a 3-D subspace, so each token's P_t is a rotation (unit-modulus complex pair);
- head 1 "low-rank head": values lie in a 2-D subspace, so every state has rank <= 2;
- head 2 "copy head": the last step writes v = E[label] with beta = 1 and the query equals that
  key, so the read-out o_t is scale * E[label_t] and a linear probe decodes the label exactly.
`correct` is True within the training length and right 30% of the time beyond it.
The states are the float64 reference recurrence's chunk-boundary states.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from deltalab.kernels.constants import CHUNK_SIZE
from deltalab.models import IGNORE_INDEX

ROTATION_HEAD, LOW_RANK_HEAD, COPY_HEAD = 0, 1, 2


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def synthetic_arrays(n_seq: int = 8, length: int = 128, n_layers: int = 2, n_heads: int = 4, n_h: int = 2,
                     dk: int = 8, dv: int = 8, vocab: int = 6, n_labels: int = 6, train_length: int = 64,
                     gated: bool = False, seed: int = 0) -> dict[str, np.ndarray]:
    """Arrays in the store schema's dim order ([seq,layer,pos,step,head,dk] ...), float32."""
    from deltalab.kernels import naive_delta_product

    rng = np.random.default_rng(seed)
    L, T, H = n_layers, length, n_heads
    tokens = rng.integers(0, vocab, size=(n_seq, T)).astype(np.int32)
    labels = rng.integers(0, n_labels, size=(n_seq, T)).astype(np.int32)
    labels[:, 0] = IGNORE_INDEX  # one unlabeled position per sequence (must be ignored)
    q = _unit(rng.normal(size=(n_seq, L, T, H, dk)))
    k = _unit(rng.normal(size=(n_seq, L, T, n_h, H, dk)))
    v = rng.normal(size=(n_seq, L, T, n_h, H, dv)) / np.sqrt(dv)
    beta = rng.uniform(0.05, 1.0, size=(n_seq, L, T, n_h, H))
    g = -np.log1p(np.exp(rng.normal(size=(n_seq, L, T, H)))) * 0.1 if gated else None

    # head 0: reflections (beta = 2) with token-determined keys in a 3-D subspace
    basis = np.linalg.qr(rng.normal(size=(dk, 3)))[0]  # dk x 3, orthonormal
    token_keys = _unit(rng.normal(size=(vocab, n_h, 3))) @ basis.T  # [vocab, n_h, dk]
    k[:, 0, :, :, ROTATION_HEAD] = token_keys[tokens]
    beta[:, 0, :, :, ROTATION_HEAD] = 2.0
    # head 1: values in a 2-D subspace -> state rank <= 2
    vbasis = np.linalg.qr(rng.normal(size=(dv, 2)))[0]
    v[:, 0, :, :, LOW_RANK_HEAD] = rng.normal(size=(n_seq, T, n_h, 2)) @ vbasis.T
    # head 2: last step writes E[label] at key k, query reads at k
    embed = _unit(rng.normal(size=(n_labels, dv))) * 2.0
    lab = np.where(labels < 0, 0, labels)
    k[:, 0, :, -1, COPY_HEAD] = k[:, 0, :, 0, COPY_HEAD] if n_h > 1 else k[:, 0, :, -1, COPY_HEAD]
    beta[:, 0, :, -1, COPY_HEAD] = 1.0
    v[:, 0, :, -1, COPY_HEAD] = embed[lab]
    q[:, 0, :, COPY_HEAD] = k[:, 0, :, -1, COPY_HEAD]
    if g is not None:
        g[:, 0, :, COPY_HEAD] = 0.0

    states, o = [], []
    for layer in range(L):
        def t(x):
            return torch.from_numpy(np.ascontiguousarray(x))
        oo, _, bnd = naive_delta_product(t(q[:, layer]), t(k[:, layer]), t(v[:, layer]), t(beta[:, layer]),
                                         None if g is None else t(g[:, layer]))
        states.append(bnd.numpy())
        o.append(oo.numpy())
    pos = np.arange(T)
    correct = np.where(pos[None, :] < train_length, True, rng.random((n_seq, T)) < 0.3)
    loss = np.where(correct, 0.01, 2.0).astype(np.float32)
    loss[labels < 0] = np.nan
    correct &= labels >= 0
    doc_start = np.zeros((n_seq, T), dtype=bool)
    doc_start[:, 0] = True
    doc_start[:, T // 2] = True
    out = {
        "tokens": tokens, "labels": labels, "doc_start": doc_start, "pad": np.zeros((n_seq, T), dtype=bool),
        "loss": loss, "correct": correct,
        "q": q, "k": k, "v": v, "beta": beta, "state": np.stack(states, 1), "o": np.stack(o, 1),
    }
    if g is not None:
        out["g"] = g
    return {name: (a.astype(np.float32) if a.dtype == np.float64 else a) for name, a in out.items()}


def write_synthetic_store(path: str | Path, *, batch_size: int = 4, train_length: int = 64,
                          **kwargs: Any) -> Path:
    """Write `synthetic_arrays(**kwargs)` as a deltalab store (through store.writer) and return its path."""
    from datetime import datetime, timezone

    from deltalab.store import schema
    from deltalab.store.writer import StoreWriter

    arrays = synthetic_arrays(train_length=train_length, **kwargs)
    n_seq, L, T, n_h, H, dk = arrays["k"].shape
    dv = arrays["v"].shape[-1]
    gated = "g" in arrays
    hooks = ["tokens", "labels", "loss", "q", "k", "v", "beta", *(["g"] if gated else []), "state", "o"]
    variables = schema.variables_for(hooks, gated=gated)
    sizes = {"pos": T, "layer": L, "head": H, "step": n_h, "dk": dk, "dv": dv, "chunk": schema.n_chunks(T)}
    config = {"model_type": "gated_deltaproduct", "vocab_size": int(arrays["tokens"].max()) + 1,
              "hidden_size": H * dk, "num_hidden_layers": L, "num_heads": H, "head_dim": dk,
              "expand_v": dv / dk, "num_householder": n_h, "use_forget_gate": gated, "use_output_gate": False,
              "use_short_conv": False, "allow_neg_eigval": True}
    attrs = {
        "deltalab_format": schema.FORMAT_VERSION, "model_config": config, "checkpoint_digest": "sha256:synthetic",
        "deltalab_version": "synthetic", "command_line": ["deltalab.probes.synthetic"], "chunk_size": CHUNK_SIZE,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "hooks": hooks,
        "variables": variables, "layers": list(range(L)), "dtype": "float32", "batch_size": batch_size,
        "sizes": sizes, "train_length": train_length,
    }
    spec = f"synthetic:seqs={n_seq},length={T}"
    writer, segment = StoreWriter.create_or_append(path, attrs, spec, n_seq)
    for start, stop in writer.pending(segment):
        writer.write_batch(start, {name: arrays[name][start - segment.start:stop - segment.start]
                                   for name in variables if name != "complete"})
    return Path(path)
