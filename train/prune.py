"""Key/query channel pruning of the rank-based state-reduction paper: scoring and checkpoint surgery.

Every method picks, per layer and head, the dk' of dk key channels to keep; the same channels are
kept in the query and in every one of the n_h keys of a head (DeltaProduct: joint selection), so the
state shrinks from dk x dv to dk' x dv (paper, Sec. 3):

- ``l1``      s_j = ||W_q[:, j]||_1 + sum_n ||W_k,n[:, j]||_1 (weights only);
- ``random``  a seeded uniformly random subset;
- ``wanda``   S-Wanda, s_j = sum_i (|W_q,ij| + sum_n |W_k,n,ij|) ||X_:i||_2 with X the layer input on the
              calibration set;
- ``grad``    Taylor, s_j = sum_i |W_q,ij dL/dW_q,ij| + sum_n |W_k,n,ij dL/dW_k,n,ij| (calibration loss);
- ``drrqr``   strong rank-revealing QR (kernels.linalg.rrqr) of the stacked activations [K_1; ...; K_nh; Q]
              (after the short conv and activation, before the L2 norm, as the authors' code does),
              a random subsample of `rrqr_rows` tokens per matrix (paper: 5k keys and 5k queries);
- ``pca``     not axis-aligned: T = top-dk' eigenvectors of the (centred) covariance of the L2-normalised
              keys and queries (pooled, equal weight), absorbed into the projections (W -> T W) and the
              depthwise convolutions by the paper's optimal diagonal adaptation W' = (T * T) W (App. B.5).
              The SiLU after the convolution does not commute with T either; the paper leaves that as is
              and so do we (it is why PCA underperforms, paper App. C.2).

Surgery (`apply_plan`) builds a model with the reduced key head dim (config `head_dim`, or `expand_k`
for delta_net; dv kept by adjusting `expand_v`) and sliced q_proj/k_proj rows and q/k conv filters;
`save_checkpoint` writes it as an fla checkpoint. The attention scale follows fla's default for the new
head dim, dk'^-0.5, as the authors' code does (their kernels are called without a scale). Every model
of the family applies a per-head RMSNorm to the read-out before o_proj, so the constant factor
sqrt(dk/dk') this puts on o cancels up to the norm's eps; `keep_scale=True` folds it into norm_eps
instead (exact for o_norm), so pruned channels that are exactly zero give the same logits (tested).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from deltalab.kernels.delta_rule.naive import l2_normalize
from deltalab.models.config import ModelConfig
from deltalab.models.lm import IGNORE_INDEX, DeltaProductForCausalLM

METHODS = ("l1", "random", "wanda", "grad", "drrqr", "pca")
NEEDS_DATA = {"wanda", "grad", "drrqr", "pca"}


class PruneError(ValueError):
    """A pruning request that cannot be carried out; the message names the fix."""


@dataclass
class LayerPlan:
    """Kept channels per head (`index` [H, k], sorted) or a semi-orthogonal map per head (`transform` [H, k, dk])."""

    index: torch.Tensor | None = None
    transform: torch.Tensor | None = None

    @property
    def kept(self) -> int:
        return int(self.index.shape[1] if self.index is not None else self.transform.shape[1])


@dataclass
class PrunePlan:
    method: str
    compression: float
    head_dim: int
    kept: int
    layers: list[LayerPlan]
    info: dict[str, Any] = field(default_factory=dict)


def kept_dim(head_dim: int, compression: float) -> int:
    """dk' = floor(dk (1 - compression)), at least 1 (the authors' rounding)."""
    if not 0 <= compression < 1:
        raise PruneError(f"compression must be in [0, 1), got {compression}: e.g. 0.5 keeps half the channels")
    return max(1, math.floor(head_dim * (1 - compression) + 1e-9))


# --- activations --------------------------------------------------------------------------------

def qk_features(attn: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries [B,T,H,dk] and keys [B,T,n_h,H,dk] after short conv and activation, before the L2 norm."""
    cfg = attn.config
    B, T = x.shape[:2]
    q, k = attn.q_proj(x), attn.k_proj(x)
    if cfg.use_short_conv:
        q, k = attn.q_conv1d(q), attn.k_conv1d(k)
    elif cfg.qk_activation == "silu":
        q, k = F.silu(q), F.silu(k)
    q = q.view(B, T, attn.num_heads, attn.head_k_dim)
    k = k.view(B, T, attn.num_householder, attn.num_heads, attn.head_k_dim)
    if cfg.qk_activation == "relu":
        q, k = q.relu(), k.relu()
    elif cfg.qk_activation == "elu":
        q, k = F.elu(q) + 1, F.elu(k) + 1
    return q, k


@dataclass
class LayerStats:
    """Calibration statistics of one layer (float64 on the CPU)."""

    x_sq: torch.Tensor  # [D] sum over tokens of the attention input squared (S-Wanda)
    rows_q: list[torch.Tensor]  # sampled raw query rows, each [n, H, dk]
    rows_k: list[torch.Tensor]  # sampled raw key rows, each [n, n_h, H, dk]
    cov_sum: torch.Tensor  # [H, dk, dk] sum of outer products of normalised q and k (per matrix)
    mean_sum: torch.Tensor  # [H, dk]
    count: int = 0  # tokens (each token adds one q and n_h k rows, weighted to q:k = 1:1)


@dataclass
class Calibration:
    """What the data-driven methods need, from one pass over calibration windows."""

    layers: list[LayerStats]
    tokens: int
    grad_scores: list[torch.Tensor] | None = None  # [H, dk] per layer


@torch.no_grad()
def collect_calibration(model: DeltaProductForCausalLM, inputs: torch.Tensor, batch_size: int = 8,
                        rrqr_rows: int = 5000, seed: int = 0, progress: bool = False) -> Calibration:
    """Input norms, sampled raw q/k rows and normalised q/k covariance per layer (model in eval mode)."""
    device = next(model.parameters()).device
    gen = np.random.default_rng([seed, 7])
    total = int(inputs.numel())
    stats: list[LayerStats] = []
    for block in model.layers:
        a = block.attn
        H, dk, D = a.num_heads, a.head_k_dim, model.config.hidden_size
        stats.append(LayerStats(torch.zeros(D, dtype=torch.float64), [], [],
                                torch.zeros(H, dk, dk, dtype=torch.float64), torch.zeros(H, dk, dtype=torch.float64)))
    captured: dict[int, torch.Tensor] = {}
    hooks = [block.attn.register_forward_pre_hook(lambda mod, args, i=i: captured.__setitem__(i, args[0]))
             for i, block in enumerate(model.layers)]
    batches = range(0, len(inputs), batch_size)
    if progress:
        from tqdm.auto import tqdm

        batches = tqdm(batches, desc="calibration", unit="batch", leave=False)
    try:
        for b0 in batches:
            x_ids = inputs[b0: b0 + batch_size].to(device)
            model(x_ids)
            n_tok = x_ids.numel()
            take = min(n_tok, max(1, math.ceil(rrqr_rows * n_tok / total)))
            pick = torch.from_numpy(gen.choice(n_tok, size=take, replace=False))
            for i, block in enumerate(model.layers):
                x = captured[i]
                st = stats[i]
                st.x_sq += x.double().square().sum((0, 1)).cpu()
                q, k = qk_features(block.attn, x)
                qf, kf = q.flatten(0, 1).double(), k.flatten(0, 1).double()  # [n,H,dk], [n,n_h,H,dk] on the device
                st.rows_q.append(qf[pick.to(qf.device)].cpu())
                st.rows_k.append(kf[pick.to(kf.device)].cpu())
                qn, kn = l2_normalize(qf), l2_normalize(kf)
                n_h = kn.shape[1]
                cov = torch.einsum("nhd,nhe->hde", qn, qn) + torch.einsum("nshd,nshe->hde", kn, kn) / n_h
                st.cov_sum += cov.cpu()
                st.mean_sum += (qn.sum(0) + kn.sum((0, 1)) / n_h).cpu()
                st.count += qf.shape[0]
    finally:
        for h in hooks:
            h.remove()
    return Calibration(stats, total)


def gradient_scores(model: DeltaProductForCausalLM, inputs: torch.Tensor, labels: torch.Tensor,
                    batch_size: int = 8, num_classes: int | None = None, progress: bool = False) -> list[torch.Tensor]:
    """Taylor scores [H, dk] per layer from the gradient of the calibration loss (summed over batches)."""
    device = next(model.parameters()).device
    params = [p for p in model.parameters()]
    flags = [p.requires_grad for p in params]
    targets = [(b.attn.q_proj.weight, b.attn.k_proj.weight) for b in model.layers]
    for p in params:
        p.requires_grad_(False)
    for wq, wk in targets:
        wq.requires_grad_(True)
        wk.requires_grad_(True)
        wq.grad = wk.grad = None
    batches = range(0, len(inputs), batch_size)
    if progress:
        from tqdm.auto import tqdm

        batches = tqdm(batches, desc="gradients", unit="batch", leave=False)
    try:
        with torch.enable_grad():
            for b0 in batches:
                x, y = inputs[b0: b0 + batch_size].to(device), labels[b0: b0 + batch_size].to(device)
                logits = model(x).logits
                if num_classes is not None:
                    logits = logits[..., :num_classes]
                F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX).backward()
        out = []
        for b, (wq, wk) in zip(model.layers, targets):
            a = b.attn
            H, dk, n_h = a.num_heads, a.head_k_dim, a.num_householder
            sq = (wq.detach() * wq.grad).abs().double().sum(1).view(H, dk)
            sk = (wk.detach() * wk.grad).abs().double().sum(1).view(n_h, H, dk).sum(0)
            out.append((sq + sk).cpu())
        return out
    finally:
        for wq, wk in targets:
            wq.grad = wk.grad = None
        for p, flag in zip(params, flags):
            p.requires_grad_(flag)


# --- scores and plans ---------------------------------------------------------------------------

def _weights(attn: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """q_proj as [H, dk, D] and k_proj as [n_h, H, dk, D] (fla's (n h d) row layout), float64."""
    H, dk, n_h = attn.num_heads, attn.head_k_dim, attn.num_householder
    wq = attn.q_proj.weight.detach().double().cpu().view(H, dk, -1)
    wk = attn.k_proj.weight.detach().double().cpu().view(n_h, H, dk, -1)
    return wq, wk


def l1_scores(attn: torch.nn.Module) -> torch.Tensor:
    wq, wk = _weights(attn)
    return wq.abs().sum(-1) + wk.abs().sum(-1).sum(0)


def wanda_scores(attn: torch.nn.Module, x_sq: torch.Tensor) -> torch.Tensor:
    wq, wk = _weights(attn)
    norms = x_sq.double().clamp(min=0).sqrt()
    return (wq.abs() * norms).sum(-1) + (wk.abs() * norms).sum(-1).sum(0)


def random_scores(H: int, dk: int, seed: int, layer: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng([seed, 11, layer]).random((H, dk)))


def top_channels(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """Indices [H, keep] of the highest scores per head, sorted (ties: lower index first)."""
    order = torch.argsort(-scores, dim=-1, stable=True)[:, :keep]
    return order.sort(dim=-1).values


def drrqr_channels(stats: LayerStats, keep: int, f: float = 1.5) -> torch.Tensor:
    """Strong-RRQR selection per head on the stacked raw key and query rows."""
    from deltalab.kernels.linalg.rrqr import select_columns

    q = torch.cat(stats.rows_q)  # [n, H, dk]
    k = torch.cat(stats.rows_k)  # [n, n_h, H, dk]
    H = q.shape[1]
    out = []
    for h in range(H):
        M = torch.cat([k[:, j, h] for j in range(k.shape[1])] + [q[:, h]]).numpy()
        out.append(torch.from_numpy(select_columns(M, keep, f).astype(np.int64)))
    return torch.stack(out)


def pca_transform(stats: LayerStats, keep: int) -> torch.Tensor:
    """[H, keep, dk]: rows = top principal axes of the pooled normalised key/query covariance (centred)."""
    n = 2 * stats.count
    mean = stats.mean_sum / n
    cov = stats.cov_sum / n - torch.einsum("hd,he->hde", mean, mean)
    _, vecs = torch.linalg.eigh(cov)  # ascending
    return vecs.flip(-1)[..., :keep].transpose(-1, -2).contiguous()


def plan(model: DeltaProductForCausalLM, method: str, compression: float, calibration: Calibration | None = None,
         seed: int = 0, rrqr_f: float = 1.5) -> PrunePlan:
    """The kept channels (or PCA maps) of every layer for one method at one compression."""
    if method not in METHODS:
        raise PruneError(f"unknown pruning method {method!r}: choose from {', '.join(METHODS)}")
    if method in NEEDS_DATA and calibration is None:
        raise PruneError(f"method {method!r} needs calibration data: pass a Calibration (collect_calibration)")
    if method == "grad" and (calibration is None or calibration.grad_scores is None):
        raise PruneError("method 'grad' needs gradient scores: set calibration.grad_scores = gradient_scores(...)")
    dk = model.config.head_k_dim
    keep = kept_dim(dk, compression)
    layers = []
    for i, block in enumerate(model.layers):
        a = block.attn
        if method == "pca":
            layers.append(LayerPlan(transform=pca_transform(calibration.layers[i], keep)))
            continue
        if method == "drrqr":
            index = drrqr_channels(calibration.layers[i], keep, rrqr_f) if keep < dk else \
                torch.arange(dk).expand(a.num_heads, dk)
            layers.append(LayerPlan(index=index.clone()))
            continue
        if method == "l1":
            scores = l1_scores(a)
        elif method == "wanda":
            scores = wanda_scores(a, calibration.layers[i].x_sq)
        elif method == "grad":
            scores = calibration.grad_scores[i]
        else:
            scores = random_scores(a.num_heads, dk, seed, i)
        layers.append(LayerPlan(index=top_channels(scores, keep)))
    return PrunePlan(method, compression, dk, keep, layers, {"seed": seed, "rrqr_f": rrqr_f})


# --- surgery ------------------------------------------------------------------------------------

def _exact_ratio(numerator: int, denominator: int, check: Callable[[float], bool]) -> float:
    """A float r close to numerator/denominator that satisfies `check` (float rounding of int(x * r))."""
    r = numerator / denominator
    for _ in range(8):
        if check(r):
            return r
        r = math.nextafter(r, math.inf)
    raise PruneError(f"cannot express {numerator}/{denominator} as an fla expand ratio")


def reduced_config(config: ModelConfig, keep: int, note: dict[str, Any] | None = None) -> ModelConfig:
    """The same config with key head dim `keep` and the value head dim unchanged."""
    H, dv = config.num_heads, config.head_v_dim
    extra = dict(config.extra)
    if note is not None:
        extra["deltalab_pruning"] = note
    if config.model_type == "delta_net":
        D = config.hidden_size
        new = dataclasses.replace(config, expand_k=_exact_ratio(H * keep, D, lambda r: D * r == H * keep),
                                  extra=extra)
    else:
        ratio = _exact_ratio(dv, keep, lambda r: int(keep * r) == dv and math.isclose(H * keep * r, H * dv,
                                                                                      rel_tol=1e-9))
        new = dataclasses.replace(config, head_dim=keep, expand_v=ratio, extra=extra)
    if new.head_k_dim != keep or new.head_v_dim != dv:
        raise PruneError(f"cannot build a config with dk={keep}, dv={dv} from {config.model_type}")
    return new


def _map_rows(weight: torch.Tensor, lead: tuple[int, ...], layer: LayerPlan) -> torch.Tensor:
    """Apply a layer plan to the row blocks (*lead, dk) of a [rows, ...] tensor, lead = (H,) or (n_h, H)."""
    rest = tuple(weight.shape[1:])
    w = weight.reshape(*lead, -1, math.prod(rest))  # [..., H, dk, R]
    if layer.index is not None:
        idx = layer.index.to(device=weight.device, dtype=torch.long)
        idx = idx.view(*([1] * (len(lead) - 1)), *idx.shape, 1).expand(*lead, idx.shape[-1], w.shape[-1])
        out = torch.take_along_dim(w, idx, dim=len(lead))
    else:
        T = layer.transform.to(device=weight.device, dtype=torch.float64)
        out = torch.einsum("hkd,...hdr->...hkr", T, w.double()).to(weight.dtype)
    return out.reshape(-1, *rest)


def _map_conv(weight: torch.Tensor, lead: tuple[int, ...], layer: LayerPlan) -> torch.Tensor:
    """Depthwise filters [C, 1, K]: sliced, or mixed by (T * T) for a rotation (paper, Prop. B.1)."""
    if layer.index is not None:
        return _map_rows(weight, lead, layer)
    return _map_rows(weight, lead, LayerPlan(transform=layer.transform.square()))


def apply_plan(model: DeltaProductForCausalLM, plan_: PrunePlan, keep_scale: bool = False) -> DeltaProductForCausalLM:
    """A new model with the reduced key head dim; every other weight copied unchanged.

    The new model's attention scale is fla's dk'^-0.5 (the paper's choice), which multiplies every
    read-out o by c = sqrt(dk / dk'). With `keep_scale` the config's norm_eps is multiplied by c^2
    instead: RMSNorm(c o, c^2 eps) = RMSNorm(o, eps), so the per-head o_norm sees exactly what the
    original scale gave (fla-compatible: norm_eps is a config field). The block norms share norm_eps;
    their inputs are O(1), so eps 1e-6 -> c^2 1e-6 moves them by ~1e-6 relative.
    """
    cfg = model.config
    if len(plan_.layers) != cfg.num_hidden_layers:
        raise PruneError(f"the plan has {len(plan_.layers)} layers, the model {cfg.num_hidden_layers}")
    keep = plan_.kept
    ratio = cfg.head_k_dim / keep
    note = {"method": plan_.method, "compression": plan_.compression, "head_dim_before": cfg.head_k_dim,
            "head_dim_after": keep,
            "attention_scale": f"head_dim_after**-0.5 (fla default; was {cfg.head_k_dim}**-0.5)",
            "norm_eps": (f"{cfg.norm_eps} x {cfg.head_k_dim}/{keep}: compensates the scale in o_norm"
                         if keep_scale else "unchanged")}
    new_cfg = reduced_config(cfg, keep, note)
    if keep_scale:
        new_cfg = dataclasses.replace(new_cfg, norm_eps=cfg.norm_eps * ratio)
    ref = next(model.parameters())
    new = DeltaProductForCausalLM(new_cfg).to(device=ref.device, dtype=ref.dtype)
    state = dict(model.state_dict())
    for i, (block, lp) in enumerate(zip(model.layers, plan_.layers)):
        a = block.attn
        H, n_h = a.num_heads, a.num_householder
        if lp.kept != keep:
            raise PruneError(f"layer {i} keeps {lp.kept} channels, others {keep}: one head dim per model")
        pre = f"layers.{i}.attn."
        state[pre + "q_proj.weight"] = _map_rows(state[pre + "q_proj.weight"], (H,), lp)
        state[pre + "k_proj.weight"] = _map_rows(state[pre + "k_proj.weight"], (n_h, H), lp)
        for conv, lead in (("q_conv1d", (H,)), ("k_conv1d", (n_h, H))):
            if pre + conv + ".weight" in state:
                state[pre + conv + ".weight"] = _map_conv(state[pre + conv + ".weight"], lead, lp)
            if pre + conv + ".bias" in state:  # a bias rotates exactly: b' = T b
                state[pre + conv + ".bias"] = _map_rows(state[pre + conv + ".bias"], lead, lp)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    new.load_state_dict(state, strict=not cfg.tie_word_embeddings)
    for block in new.layers:  # keep fla's float32 gate parameters as they were
        for name in ("A_log", "dt_bias"):
            if hasattr(block.attn, name):
                getattr(block.attn, name).data = getattr(block.attn, name).data.float()
    return new.eval()


def prune(model: DeltaProductForCausalLM, method: str, compression: float, calibration: Calibration | None = None,
          seed: int = 0, rrqr_f: float = 1.5, keep_scale: bool = False) -> tuple[DeltaProductForCausalLM, PrunePlan]:
    """plan + apply_plan in one call."""
    p = plan(model, method, compression, calibration, seed, rrqr_f)
    return apply_plan(model, p, keep_scale), p


def parse_methods(text: str | Iterable[str]) -> list[str]:
    """'l1,grad' or ['l1', 'grad'] or 'all' -> validated method names."""
    names = [s.strip().lower() for s in (text.split(",") if isinstance(text, str) else text) if s.strip()]
    if names == ["all"]:
        return list(METHODS)
    aliases = {"s-wanda": "wanda", "swanda": "wanda", "taylor": "grad", "rrqr": "drrqr", "rand": "random"}
    names = [aliases.get(n, n) for n in names]
    bad = [n for n in names if n not in METHODS]
    if bad or not names:
        raise PruneError(f"unknown method(s) {', '.join(bad) or '(none)'}: choose from {', '.join(METHODS)} or all")
    return list(dict.fromkeys(names))
