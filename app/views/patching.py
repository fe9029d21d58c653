"""Patching: what `deltalab patch ... --store STORE` found, as heatmaps.

Activation patching: layer x head for a head hook (at one position, or every position at once), position x layer
for the residual stream; attribution patching's estimate beside the actual patch when both are in the store;
state patching: head x token for one layer. Values are normalised: 0 = the corrupted run's metric, 1 = the
clean run's.
"""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
import streamlit as st

from deltalab.app.dash import export

RESULTS = {"activation": "patching-activation", "attribution": "patching-attribution", "state": "patching-state"}


def heatmap(z: np.ndarray, x: list, y: list, title: str, x_title: str, y_title: str) -> go.Figure:
    """A diverging heatmap centred on 0 (corrupted) with 1 (clean) at full red."""
    bound = float(np.nanmax(np.abs(z))) if np.isfinite(z).any() else 1.0
    fig = go.Figure(go.Heatmap(z=z, x=x, y=y, colorscale="RdBu", reversescale=True, zmid=0,
                               zmin=-max(bound, 1.0), zmax=max(bound, 1.0), colorbar={"title": "restored"},
                               hovertemplate=f"{x_title} %{{x}}<br>{y_title} %{{y}}<br>%{{z:.3f}}<extra></extra>"))
    fig.update_layout(title=title, xaxis_title=x_title, yaxis_title=y_title, height=360,
                      margin={"l": 50, "r": 20, "t": 50, "b": 40})
    fig.update_yaxes(autorange="reversed")
    return fig


def _result(ctx, kind: str):
    from deltalab.app.dash import loading

    names = loading.result_names(ctx.path, RESULTS[kind])
    return loading.read_result(ctx.path, names[0]).load() if names else None


def _caption(res) -> None:
    a = res.attrs
    st.caption(f"{a.get('experiment')} ({a.get('direction')}), metric `{a.get('metric')}`: clean "
               f"{float(a.get('clean_metric', np.nan)):.4g}, corrupted {float(a.get('corrupted_metric', np.nan)):.4g}")


def _activation(ctx, res, attribution) -> None:
    hooks = [str(h) for h in res["hook"].values]
    hook = st.selectbox("Hook", hooks, key="patch_hook")
    positions = [int(p) for p in res["position"].values]
    sub = res["patched"].sel(hook=hook)
    layers, heads = [int(x) for x in res["layer"].values], [int(h) for h in res["head"].values]
    if hook.startswith("resid"):
        z = sub.sel(head=-1).values  # [layer, position]
        export.chart(heatmap(z.T, layers, positions, f"{hook}: position x layer", "layer", "position"),
                     key="patch_resid", data=sub.sel(head=-1).to_dataframe().reset_index())
        return
    choices = ["every position"] if positions == [-1] else positions
    pos = st.selectbox("Position", choices, index=len(choices) - 1, key="patch_pos")
    p = -1 if pos == "every position" else int(pos)
    head_cols = [h for h in heads if h >= 0] or heads
    z = sub.sel(position=p, head=head_cols).values  # [layer, head]
    cols = st.columns(2 if attribution is not None else 1)
    with cols[0]:
        export.chart(heatmap(z, head_cols, layers, f"{hook} patched at position {pos}", "head", "layer"),
                     key="patch_heads", data=sub.sel(position=p).to_dataframe().reset_index())
    if attribution is not None and hook in attribution["hook"].values and p in attribution["position"].values:
        est = attribution["attribution"].sel(hook=hook, position=p, head=head_cols)
        est = est.sel(layer=[x for x in layers if x in est["layer"].values])
        with cols[1]:
            export.chart(heatmap(est.values, head_cols, layers, f"{hook}: attribution estimate", "head", "layer"),
                         key="patch_attr", data=est.to_dataframe().reset_index())
            actual, guess = z.ravel(), est.values.ravel()
            keep = np.isfinite(actual) & np.isfinite(guess)
            if keep.sum() > 2:
                from scipy.stats import spearmanr

                rho = spearmanr(actual[keep], guess[keep]).statistic
                st.caption(f"Rank correlation with actual patching: {rho:.3f}")


def _state(ctx, res) -> None:
    layers = [int(x) for x in res["layer"].values]
    layer = st.selectbox("Layer", layers, key="patch_state_layer")
    part = st.selectbox("Part of the state", [str(p) for p in res["part"].values], key="patch_state_part")
    sub = res["patched"].sel(layer=layer, part=part)
    export.chart(heatmap(sub.values, [int(t) for t in res["token"].values], [int(h) for h in res["head"].values],
                         f"layer {layer}: state after token patched ({part})", "token", "head"),
                 key="patch_state", data=sub.to_dataframe().reset_index())


def render(ctx) -> None:
    st.title("Patching")
    found = {kind: _result(ctx, kind) for kind in RESULTS}
    if all(v is None for v in found.values()):
        st.info("**No patching results in this store yet.** Patch two of its sequences into each other:\n\n"
                f"```\ndeltalab patch {ctx.checkpoint or 'CHECKPOINT'} --store {ctx.path} --clean-seq 0 "
                "--corrupted-seq 1 --metric kl --hooks resid_pre,o\n```\n(add `--experiment state` or "
                "`--experiment attribution` for the other views), then press **Reload** in the sidebar.")
        return
    if found["activation"] is not None:
        st.subheader("Activation patching")
        _caption(found["activation"])
        _activation(ctx, found["activation"], found["attribution"])
    elif found["attribution"] is not None:
        st.subheader("Attribution patching")
        _caption(found["attribution"])
        _activation(ctx, found["attribution"].rename({"attribution": "patched"}), None)
    if found["state"] is not None:
        st.subheader("State patching")
        _caption(found["state"])
        _state(ctx, found["state"])
