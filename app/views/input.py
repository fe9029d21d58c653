"""Input: type your own sequence (text for language models, token ids or names for task models), run the store's
checkpoint on it with the hooks (CPU or GPU, loaded on demand), and see it on every page: the sidebar's "Show"
switches every page between the store and your input. No capture is written."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import plotly.graph_objects as go
import streamlit as st

from deltalab.app.dash import export, figures, loading, own_input, roots, state, textgrid
from deltalab.app.dash import traces as tr
from deltalab.app.dash.derive import name_of

TEXT_EXAMPLE = ('def fib(n):\n    """Return the n-th Fibonacci number."""\n    a, b = 0, 1\n    for _ in range(n):\n'
                '        a, b = b, a + b\n    return a\n')
PAGES = ("Text", "Attention", "Betas", "Keys", "Spectra", "Effective rank", "Token", "Heads")
ATTENTION_MAX_TOKENS = 512
"""Longest input whose full attention map the page draws (T x T cells)."""


@st.cache_data(show_spinner=False, max_entries=16)
def _attention(key: str, stamp: float, li: int, head: int) -> np.ndarray | None:
    return input_attention(loading._open(key, stamp), li, head)


def _warm(checkpoint: str, device: str) -> None:
    """Load and warm the model in the background while the researcher types (errors surface on Run)."""
    if not checkpoint or own_input.is_loaded(checkpoint, device) or not (Path(checkpoint) / "config.json").is_file():
        return
    import threading

    def work() -> None:
        try:
            own_input.get_model(checkpoint, device)
        except Exception:  # noqa: BLE001 - reported when Run is pressed
            pass

    threading.Thread(target=work, name="deltalab-input-warmup", daemon=True).start()


def _devices() -> list[str]:
    try:
        import torch

        return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    except ImportError:  # pragma: no cover - torch is a dependency
        return ["cpu"]


def _run(store: str, attrs_json: str, names: list[str] | None, deferred: bool = False) -> None:
    """Button callback: encode, run, register the input and switch every page to it (errors kept for the page).
    `deferred`: called while the page draws (a URL's input), so the widget-bound choices wait for the next run."""
    st.session_state.pop("input_error", None)
    attrs = json.loads(attrs_json)
    checkpoint = (st.session_state.get("input_checkpoint") or "").strip()
    if not checkpoint or not (Path(checkpoint) / "config.json").is_file():
        st.session_state["input_error"] = (f"no checkpoint at {checkpoint or '(empty)'}: type the folder the store "
                                           "was captured from (it holds config.json and model.safetensors)")
        return
    timing = own_input.Timing()
    try:
        enc = own_input.encode(st.session_state.get("input_text") or "", attrs,
                               textgrid.tokenizer_file(Path(checkpoint)), names)
        import time

        t0 = time.perf_counter()
        model = own_input.get_model(checkpoint, st.session_state.get("input_device") or "cpu")
        timing.add("load model (once, in the background)", t0)
        ds = own_input.run(model, enc, attrs, timing)
    except own_input.InputError as err:
        st.session_state["input_error"] = str(err)
        return
    except Exception as err:  # noqa: BLE001 - a bad checkpoint or device: one line in the page
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        st.session_state["input_error"] = f"the model could not run on this input ({type(err).__name__}: {first})"
        return
    key = own_input.input_key(store, enc)
    loading.register_memory(key, ds)
    st.session_state[state.INPUT_KEY] = key
    st.session_state["input_timing"] = dict(timing.stages)
    if deferred:
        state.defer(**{state.SOURCE_KEY: state.SOURCES[1], state.KEYS["seq"]: 0, state.KEYS["pos"]: 0})
        return
    st.session_state[state.SOURCE_KEY] = state.SOURCES[1]
    state.select(seq=0, pos=0)


def _random_fill(vocab: int, names: list[str] | None) -> None:
    n = int(st.session_state.get("input_random_n") or 256)
    rng = np.random.default_rng()
    st.session_state["input_text"] = " ".join(str(int(i)) for i in rng.integers(0, vocab, n))


def input_attention(ds, li: int, head: int) -> np.ndarray | None:
    """The exact signed attention map [query token, source token] of value head `head` in layer index `li` of an
    input dataset (alpha summed over each source token's Householder sub-steps), or None without q, k, v, beta."""
    if not all(v in ds for v in ("q", "k", "v", "beta")):
        return None
    import torch

    from deltalab.kernels.attention.chunk import delta_attention
    from deltalab.store.reader import per_value_head

    one = per_value_head(ds).isel(seq=[0], layer=li, head=[head])

    def t(name: str) -> torch.Tensor:
        return torch.as_tensor(np.asarray(one[name].values, dtype=np.float64))

    if "kappa" in one:  # rwkv7: diagonal-plus-rank-one transitions diag(e^g) - (kappa * a) kappa^T, scale 1
        from deltalab.kernels.attention.dplr_chunk import dplr_attention

        kap, a = t("kappa")[:, :, 0], t("beta")[:, :, 0]  # [1, T, 1, dk]
        g = t("g") if "g" in one else None
        amap = dplr_attention(t("q"), t("k")[:, :, 0], t("v")[:, :, 0], -kap, kap * a, g, scale=1.0)
        return amap.weights[0, :, 0, :, 0].numpy()  # [T query, T source]

    q, k, v, beta = t("q"), t("k"), t("v"), t("beta")  # [1, T, 1, dk], [1, T, n_h, 1, dk], ...
    g = t("g") if "g" in one else None
    amap = delta_attention(q, k, v, beta, g, scale=q.shape[-1] ** -0.5)
    return amap.weights[0, :, 0].sum(-1).numpy()  # [T query, T source]


def attention_figure(weights: np.ndarray, labels: list[str], layer: int, head: int, pos: int | None) -> go.Figure:
    """Signed attention heatmap (diverging, centred at 0): row = query token, column = source token. Streamlit
    reports no selection for a click on a heatmap, so invisible points over the causal cells carry the hover and the
    click (customdata [query, source]), as the Text page's token grid does."""
    T = weights.shape[0]
    lim = float(np.abs(weights).max()) or 1.0
    fig = go.Figure(tr.Heatmap(z=weights, colorscale="RdBu", zmid=0, zmin=-lim, zmax=lim, colorbar=dict(title="α"),
                               hoverinfo="skip"))
    qi, si = np.tril_indices(T)
    text = [f"query {i} {labels[i]!s} ← source {j} {labels[j]!s}<br>α = {weights[i, j]:.4f}"
            for i, j in zip(qi.tolist(), si.tolist())]
    points = go.Scattergl if len(qi) > 20_000 else go.Scatter  # WebGL above ~20k points (up to 512 tokens)
    fig.add_trace(points(x=si, y=qi, mode="markers", customdata=np.stack([qi, si], 1), text=text,
                         marker=dict(symbol="square", size=max(4, min(14, 600 // max(T, 1))), opacity=0.0,
                                     color="black"),
                         hovertemplate="%{text}<extra></extra>", showlegend=False, name="cells",
                         unselected=dict(marker=dict(opacity=0.0)), selected=dict(marker=dict(opacity=0.0)),
                         _validate=False))
    if pos is not None and 0 <= pos < T:
        fig.add_hrect(y0=pos - 0.5, y1=pos + 0.5, line=dict(color="black", width=1))
    fig.update_xaxes(title_text="source token", range=[-0.5, T - 0.5])
    fig.update_yaxes(title_text="query token", autorange="reversed")
    return figures._layout(fig, f"Exact attention α (signed) of layer {layer}, head {head}: o_t = Σ α_t,s v_s",
                           max(320, min(700, 12 * T)))


def _attention_click() -> None:
    cd = state.clicked("input_attention")
    if cd is not None and len(cd) >= 2:
        state.select(seq=0, pos=int(cd[1]))  # the source token


def betas_figure(beta: np.ndarray, bmax: float, step: int, layer: int, head: int, name: str = "β") -> go.Figure:
    """beta [pos, head] of one step as a heatmap (heads on y), the selected head outlined."""
    T, H = beta.shape
    fig = go.Figure(tr.Heatmap(z=beta.T, x=np.arange(T), y=[f"h{h}" for h in range(H)], colorscale=figures.BETA_SCALE,
                               zmin=0, zmax=bmax, colorbar=dict(title="β"),
                               hovertemplate=f"pos %{{x}}, %{{y}}: {name} = %{{z:.3f}}<extra></extra>"))
    fig.add_hrect(y0=head - 0.5, y1=head + 0.5, line=dict(color="red", width=2))
    fig.update_xaxes(title_text="position")
    fig.update_yaxes(title_text="head", autorange="reversed")
    return figures._layout(fig, f"{name} of step {step} at every position and head, layer {layer}",
                           max(240, 120 + 22 * H))


def render(ctx) -> None:
    st.title("Your input")
    store = st.session_state.get(state.STORE_KEY) or str(ctx.path)
    attrs = {k: v for k, v in ctx.attrs.items() if k != "input"}
    text_model = textgrid.is_text_store(attrs)
    vocab = int(ctx.cfg.get("vocab_size") or 2)
    st.caption("Type a sequence, run the store's checkpoint on it with the hooks, and every page shows it "
               "(switch with **Show** in the sidebar). Nothing is written to the store.")
    # a shared URL carries the typed input (and its checkpoint): noted once, when the session opens on it
    from_url = st.session_state.setdefault("input_from_url", "input_text" in st.query_params)
    own = str(ctx.checkpoint or "")
    if "input_checkpoint" not in st.session_state and "input_checkpoint" in st.query_params:
        _checkpoint_from_url(st.query_params["input_checkpoint"], own)
    if "input_checkpoint" not in st.session_state and "input_checkpoint" not in st.query_params:
        st.session_state["input_checkpoint"] = own
    if "input_text" not in st.session_state and not from_url:
        st.session_state["input_text"] = TEXT_EXAMPLE if text_model else " ".join(
            str(int(i)) for i in np.random.default_rng(0).integers(0, vocab, 256))
    c1, c2 = st.columns([4, 1])
    c1.text_input("Checkpoint", key="input_checkpoint",  # unbound once a link's checkpoint was refused
                  bind=None if st.session_state.get("input_checkpoint_unbound") else "query-params",
                  help="The folder the store was captured from (found from the store's provenance).")
    c2.selectbox("Device", _devices(), key="input_device")
    if not from_url:  # a link's page loads nothing until its reader presses Run
        _warm(st.session_state["input_checkpoint"], st.session_state.get("input_device") or "cpu")
    if text_model:
        tok = textgrid.tokenizer_file(Path(st.session_state["input_checkpoint"] or "."))
        st.text_area("Text", key="input_text", height=220, bind="query-params",
                     help=f"Encoded by {'the checkpoint’s tokenizer.json' if tok else 'UTF-8 bytes'}; "
                          "the label of each token is the next one.")
    else:
        task = own_input.task_name(attrs)
        st.text_area(f"Tokens of {task or 'the task'}", key="input_text", height=120, bind="query-params",
                     help="Token ids (0.."
                          f"{vocab - 1}) or token names, separated by spaces or commas. For a group task the labels "
                          "are the running product, so loss and accuracy are real.")
        r1, r2 = st.columns([1, 3])
        r1.number_input("Random length", 1, own_input.MAX_TOKENS, 256, key="input_random_n")
        r2.button("Fill with a random sequence", on_click=_random_fill, args=(vocab, ctx.names), key="input_random")
    st.button("Run the model on this input", type="primary", key="input_run", on_click=_run,
              args=(store, json.dumps(attrs, default=str), ctx.names))
    if st.session_state.pop("input_checkpoint_refused", False):
        st.warning(roots.REFUSED_CHECKPOINT)
    key = st.session_state.get(state.INPUT_KEY)
    if from_url and not (key and loading.in_memory(key)) and not st.session_state.get("input_error"):
        st.info("**This link carries an input.** Nothing has run yet: check the checkpoint and the text above, then "
                "press **Run the model on this input** to see it on every page.")
        return
    if st.session_state.get("input_error"):
        st.error(st.session_state["input_error"])
        return
    key = st.session_state.get(state.INPUT_KEY)
    if not key or not str(key).startswith(f"{store}#") or not loading.in_memory(key):
        st.info("Run the model to see your input on every page.")
        return
    ds = loading._open(str(key), loading._stamp(key))
    info = ds.attrs.get("input") or {}
    timing = st.session_state.get("input_timing") or {}
    m = st.columns(4)
    m[0].metric("Tokens", info.get("tokens", ds.sizes["pos"]))
    m[1].metric("Run with hooks", f"{timing.get('run with hooks', float('nan')):.2f} s")
    m[2].metric("Waited for the model", f"{timing.get('load model (once, in the background)', 0.0):.2f} s",
                help="Loaded and warmed up once per server, in the background when this page opens.")
    if "loss" in ds and np.isfinite(np.asarray(ds["loss"].values)).any():
        m[3].metric("Mean loss", f"{float(np.nanmean(np.asarray(ds['loss'].values))):.3f}")
    if st.session_state.get(state.SOURCE_KEY) != state.SOURCES[1]:
        st.warning("The pages show the store: choose **your input** under **Show** in the sidebar to see it.")
    li = ctx.layers.index(ctx.sel.layer) if ctx.sel.layer in ctx.layers else 0
    if "beta" in ds:
        beta = np.asarray(ds["beta"].isel(seq=0, layer=li, step=min(ctx.sel.step, ds.sizes["step"] - 1)).values)
        name = "β"
        if beta.ndim == 3 and "kappa" in ds:  # rwkv7 [T, H, dk]: the effective removal strength sum kappa^2 a
            kap = np.asarray(ds["kappa"].isel(seq=0, layer=li, step=0).values)
            beta, name = (kap * kap * beta).sum(-1), "effective β = Σ κ² a"
        export.chart(betas_figure(beta, ctx.beta_max, ctx.sel.step, ctx.sel.layer, ctx.sel.head, name),
                     "input_betas")
    if ds.sizes["pos"] <= ATTENTION_MAX_TOKENS:
        weights = _attention(str(key), loading._stamp(key), li, int(ctx.sel.head))
        if weights is not None:
            tokens = np.asarray(ds["tokens"].values[0]) if "tokens" in ds else np.arange(weights.shape[0])
            labels = [name_of(ctx.names, int(t)) for t in tokens]
            st.caption("Which earlier tokens each output reads from, exactly: the delta rule's key removal "
                       "included (signed: reflections flip signs). Click a cell to select its source token.")
            export.chart(attention_figure(weights, labels, ctx.sel.layer, ctx.sel.head, ctx.sel.pos),
                         "input_attention", on_select=_attention_click, selection_mode="points")
    st.markdown("**See it on:**")
    cols = st.columns(len(PAGES))
    for c, page in zip(cols, PAGES):
        c.button(f"{page} →", on_click=_show_on, args=(page,), key=f"input_go_{page}", width="stretch")


def _checkpoint_from_url(value: str, own: str) -> None:
    """A checkpoint named by the URL stays only when it is the store's own or under the dashboard's roots
    (app.dash.roots); otherwise the store's own takes its place and the page says so (a link never loads a
    folder its reader did not choose)."""
    if roots.checkpoint_permitted(value, own or None):
        return
    st.query_params.pop("input_checkpoint", None)
    st.session_state["input_checkpoint"] = own
    st.session_state["input_checkpoint_unbound"] = True  # the URL's value would win on the first run otherwise
    st.session_state["input_checkpoint_refused"] = True


def _show_on(page: str) -> None:
    st.session_state[state.SOURCE_KEY] = state.SOURCES[1]
    state.go_to(page)
