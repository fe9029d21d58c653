"""Small derived quantities the dashboard shows (pure numpy, no Streamlit): one token's transition matrix,
model cards from store attributes, parameter counts from a safetensors header, token names.

Everything here reads at most one token's arrays or a file header: the bulk arrays stay lazy.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass
class Transition:
    """One token's transition A_t = a_t P_t, P_t = (I - b_n k_n k_n^T) ... (I - b_1 k_1 k_1^T)."""

    keys: np.ndarray  # [n_h, dk] (rows k_1..k_n, L2-normalised as stored)
    betas: np.ndarray  # [n_h]
    gate: float  # a_t = exp(g_t) (1.0 without a forget gate)
    gram: np.ndarray  # [n_h, n_h] K^T K
    P: np.ndarray  # [dk, dk]
    eigenvalues: np.ndarray  # [n_h] complex: P's non-trivial eigenvalues (the other dk - n_h are 1)
    key_angles_deg: np.ndarray  # [n_h, n_h] angle between the reflection planes (0..90 degrees)
    channel_decays: np.ndarray | None = None  # [dk] exp(g_t) per key channel (Kimi Delta Attention, RWKV-7), else None
    kappa: np.ndarray | None = None  # [dk] RWKV-7's removal key (keys[0] is kappa too), else None
    channel_betas: np.ndarray | None = None  # [dk] RWKV-7's removal strengths a_rwkv per key channel, else None

    @property
    def dplr(self) -> bool:
        """RWKV-7: A_t = diag(e^g_t) - (kappa * a) kappa^T, P_t = I - (kappa * a) kappa^T."""
        return self.kappa is not None

    @property
    def dk(self) -> int:
        return int(self.keys.shape[1])

    @property
    def eigenvalues_A(self) -> np.ndarray:
        """Non-trivial eigenvalues of A_t: P's times the gate; with a per-channel gate all dk eigenvalues of
        A_t = P_t diag(d), exact by the secular equation (n_h = 1)."""
        if self.channel_decays is None:
            return self.eigenvalues * self.gate
        import torch

        from deltalab.kernels.spectra.dplr import dplr_eigvals, dplr_eigvals_general

        if self.kappa is not None and self.channel_betas is not None:
            d, kap = (torch.as_tensor(x, dtype=torch.float64) for x in (self.channel_decays, self.kappa))
            u = kap * torch.as_tensor(self.channel_betas, dtype=torch.float64)
            return dplr_eigvals_general(d[None], -kap[None], u[None])[0].numpy().astype(np.complex128)

        d = torch.as_tensor(self.channel_decays, dtype=torch.float64)
        k = torch.as_tensor(self.keys[0], dtype=torch.float64)
        lam = dplr_eigvals(d[None], k[None], torch.as_tensor(self.betas[:1], dtype=torch.float64))[0]
        return lam.numpy().astype(np.complex128)

    @property
    def A(self) -> np.ndarray:
        """The transition matrix: gate * P, or P diag(d) with a per-channel gate."""
        if self.channel_decays is None:
            return self.P * self.gate
        if self.kappa is not None:  # the rank-one removal is not decayed: diag(d) + (P - I)
            return np.diag(self.channel_decays) + self.P - np.eye(self.dk)
        return self.P * self.channel_decays[None, :]

    @property
    def rotation_deg(self) -> float:
        """Largest |arg| of the non-trivial eigenvalues: the rotation angle when they are a unit-modulus pair."""
        return float(np.degrees(np.abs(np.angle(self.eigenvalues))).max()) if self.eigenvalues.size else 0.0


def transition(keys: np.ndarray, betas: np.ndarray, g: float | np.ndarray | None = None) -> Transition:
    """Build one token's transition from its n_h keys [n_h, dk], betas [n_h] and log gate g (or None).

    The non-trivial eigenvalues come from the n_h x n_h compact-WY matrix C = (I + B L)^-1 (I - B U)
    (L, U = strict lower / upper-with-diagonal parts of the Gram matrix): exact, never a dense dk x dk eig.
    """
    k = np.asarray(keys, dtype=np.float64)
    b = np.asarray(betas, dtype=np.float64)
    n, dk = k.shape
    gram = k @ k.T
    eye = np.eye(n)
    c = np.linalg.solve(eye + b[:, None] * np.tril(gram, -1), eye - b[:, None] * np.triu(gram))
    eig = np.linalg.eigvals(c).astype(np.complex128)
    eig = eig[np.lexsort((np.abs(eig), np.angle(eig)))]
    P = np.eye(dk)
    for j in range(n):
        P = (np.eye(dk) - b[j] * np.outer(k[j], k[j])) @ P
    norms = np.sqrt(np.clip(np.diag(gram), 1e-30, None))
    cos = np.clip(np.abs(gram) / np.outer(norms, norms), 0.0, 1.0)
    if g is not None and np.ndim(g) == 1:  # per-channel gate: A_t = P_t diag(exp g)
        decays = np.exp(np.nan_to_num(np.asarray(g, dtype=np.float64), nan=0.0))
        return Transition(k, b, 1.0, gram, P, eig, np.degrees(np.arccos(cos)), decays)
    gate = float(np.exp(g)) if g is not None and np.isfinite(g) else 1.0
    return Transition(k, b, gate, gram, P, eig, np.degrees(np.arccos(cos)))


def dplr_transition(kappa: np.ndarray, betas: np.ndarray, g: np.ndarray) -> Transition:
    """One RWKV-7 token's transition from its removal key kappa [dk], per-channel removal strengths a_rwkv [dk] and
    log decays g [dk]: P_t = I - (kappa * a) kappa^T has one non-trivial eigenvalue 1 - sum_i kappa_i^2 a_i (the
    effective beta is sum_i kappa_i^2 a_i); A_t = diag(e^g) + P_t - I, all dk eigenvalues exact
    (`Transition.eigenvalues_A`, secular equation)."""
    kap = np.asarray(kappa, dtype=np.float64)
    a = np.nan_to_num(np.asarray(betas, dtype=np.float64), nan=0.0)
    u = kap * a
    dk = kap.shape[0]
    P = np.eye(dk) - np.outer(u, kap)
    b_eff = float(kap @ u)
    decays = np.exp(np.nan_to_num(np.asarray(g, dtype=np.float64), nan=0.0))
    gram = np.array([[float(kap @ kap)]])
    return Transition(kap[None], np.array([b_eff]), 1.0, gram, P, np.array([1.0 - b_eff], np.complex128),
                      np.zeros((1, 1)), decays, kappa=kap, channel_betas=a)


# --- model card -----------------------------------------------------------------------------

def model_summary(cfg: dict[str, Any], n_params: int | None = None) -> str:
    """The one-paragraph summary `DeltaProductForCausalLM.summary()` prints, from the config alone."""
    n_h = cfg.get("num_householder", 1)
    gates = [name for name, key in (("forget", "use_forget_gate"), ("output", "use_output_gate"),
                                    ("short-conv", "use_short_conv")) if cfg.get(key)]
    eig = "[-1,1]" if cfg.get("allow_neg_eigval") else "[0,1]"
    dk = cfg.get("head_k_dim") or cfg.get("head_dim")
    dv = cfg.get("head_v_dim") or (int(dk * cfg.get("expand_v", 1)) if dk else None)
    text = (f"{cfg.get('model_type', '?')} n_h={n_h} {eig}: {cfg.get('num_hidden_layers', '?')} layer(s), "
            f"{cfg.get('num_heads', '?')} heads, dk={dk} dv={dv}, hidden={cfg.get('hidden_size', '?')}, "
            f"vocab={cfg.get('vocab_size', '?')}, {', '.join(gates) or 'no gates/conv'}")
    if n_params is not None:
        text += f"; {n_params / 1e6:.2f}M parameters"
    return text


def find_checkpoint(attrs: dict[str, Any]) -> Path | None:
    """The checkpoint folder a store was captured from, when it is still on this machine."""
    cmd = [str(c) for c in attrs.get("command_line") or []]
    if "capture" in cmd:
        i = cmd.index("capture")
        if i + 1 < len(cmd):
            p = Path(cmd[i + 1])
            if (p / "config.json").is_file():
                return p
    from deltalab.app.default_store import bundled_checkpoint, has_bundled_checkpoint

    zoo = bundled_checkpoint()
    if has_bundled_checkpoint(zoo) and attrs.get("checkpoint_digest", "").startswith("sha256:"):
        return zoo if _same_weights(zoo, attrs["checkpoint_digest"]) else None
    return None


def _same_weights(folder: Path, digest: str) -> bool:
    import hashlib

    f = folder / "model.safetensors"
    if not f.is_file() or f.stat().st_size > 512 * 2**20:  # do not hash big files on a page load
        return False
    return "sha256:" + hashlib.sha256(f.read_bytes()).hexdigest() == digest


def param_count(checkpoint: Path) -> int | None:
    """Number of parameters from model.safetensors' JSON header (no tensor is read, torch is not imported)."""
    f = checkpoint / "model.safetensors"
    try:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > 100 * 2**20:
                return None
            header = json.loads(fh.read(n))
    except (OSError, ValueError, struct.error):
        return None
    return int(sum(int(np.prod(v["shape"])) for k, v in header.items() if k != "__metadata__"))


def readme(checkpoint: Path | None) -> str | None:
    """README.md beside the checkpoint (the zoo's model card), if any: a regular file of at most 1 MB."""
    if checkpoint is None or not (checkpoint / "README.md").is_file():
        return None
    from deltalab.models.errors import CheckpointError
    from deltalab.models.files import read_capped

    try:
        return read_capped(checkpoint / "README.md", 1 << 20, "model card").decode("utf-8")
    except (OSError, UnicodeDecodeError, CheckpointError):
        return None


# --- token names -----------------------------------------------------------------------------

def token_names(attrs: dict[str, Any], vocab_size: int | None = None) -> list[str] | None:
    """Names of the input token ids when the store's data is a task (e.g. S4 permutations), else None."""
    meta = attrs.get("data_meta") or {}
    task = (meta.get("task") or {}).get("name") if isinstance(meta, dict) else None
    if not task:
        spec = str(attrs.get("data_spec", ""))
        task = spec.split(":", 1)[0] if ":" in spec and not spec.startswith(("csv", "text", "synthetic")) else None
    if not task:
        return None
    try:
        from deltalab.tasks.state_tracking import get_task

        names = list(get_task(task).token_names)
    except Exception:  # noqa: BLE001 - unknown or changed task: fall back to ids
        return None
    if not names or (vocab_size is not None and len(names) < vocab_size):
        return None
    return names


def name_of(names: list[str] | None, token: int) -> str:
    """'17 (1, 4, 3, 2)' or '17' when names are unknown."""
    if names is not None and 0 <= token < len(names):
        return f"{token} {names[token]}"
    return str(token)


def seqs_for_points(n_seq: int, length: int, max_points: int) -> int:
    """How many whole sequences fit `max_points` tokens (at least 1)."""
    return max(1, min(n_seq, max_points // max(1, length)))


