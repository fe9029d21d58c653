"""Overview: the model card, capture provenance, completeness, variable sizes and which probes have run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import streamlit as st

from deltalab.app.dash import export, figures, loading
from deltalab.app.dash.derive import model_summary, param_count, readme
from deltalab.app.dash.safe import code_text, markdown_text, table_rows
from deltalab.store.schema import human_bytes

PROBES = ("betas", "keys", "spectra", "erank", "linear", "lengthgen", "intervene")


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@st.cache_data(show_spinner=False, ttl=30)
def _info(path: str, stamp: float) -> dict[str, Any]:
    """Variables (dims, shape, dtype, bytes in memory and on disk) and completeness, from metadata + `complete`."""
    ds = loading._open(path, stamp)
    root = Path(path)
    complete_all = None
    try:
        import zarr

        complete_all = np.asarray(zarr.open_array(str(root / "complete"), mode="r")[:], dtype=bool)
    except Exception:  # noqa: BLE001 - fall back to the visible sequences
        complete_all = np.ones(ds.sizes["seq"], bool)
    from deltalab.store import schema

    order = {name: i for i, name in enumerate(schema.VARIABLES)}
    variables = []
    for name, da in sorted(ds.data_vars.items(), key=lambda kv: (order.get(str(kv[0]), len(order)), str(kv[0]))):
        variables.append({"variable": str(name), "dims": ", ".join(map(str, da.dims)),
                          "shape": " × ".join(str(n) for n in da.shape), "dtype": str(da.dtype),
                          "in memory": int(da.size * da.dtype.itemsize),
                          "on disk": _dir_bytes(root / str(name)) if (root / str(name)).is_dir() else 0,
                          "captured": str(name) in ds.attrs.get("variables", [])})
    return {"variables": variables, "complete": int(complete_all.sum()), "total": int(complete_all.size),
            "results_bytes": _dir_bytes(root / "results") if (root / "results").is_dir() else 0}


def _cell(value: Any) -> str:
    """A markdown table cell showing a stored value as text (app.dash.safe): code-formatted when it looks like
    a spec or version, escaped otherwise; pipes escaped either way (they would end the cell)."""
    text = str(value)
    if any(c in text for c in ":=,") and " " not in text:
        return code_text(text).replace("|", "\\|")
    return markdown_text(text)


def _findings(ctx) -> None:
    """The heads that stand out on each probe that has run, each linked to the page that shows it."""
    from deltalab.app.dash import findings, state

    results = {name: ctx.result(name) for name in ("betas", "spectra", "erank")}
    found = findings.findings({k: v for k, v in results.items() if v is not None})
    if not found:
        return
    st.subheader("Findings")
    for i, f in enumerate(found):
        c1, c2 = st.columns([5, 1])
        c1.markdown(f"**{f.probe}** · layer {f.layer} head {f.head}: {f.text}")
        c2.button(f"{f.page} →", key=f"finding_{i}", on_click=state.go_to, args=(f.page,),
                  kwargs={"layer": f.layer, "head": f.head}, width="stretch")


def render(ctx) -> None:
    attrs, cfg, ds = ctx.attrs, ctx.cfg, ctx.ds
    st.title("Overview")
    st.caption(f"{code_text(ctx.path)} · deltalab store format {markdown_text(attrs.get('deltalab_format'))}")
    info = _info(str(ctx.path), loading._stamp(ctx.path))
    stored = sum(v["on disk"] for v in info["variables"]) + info["results_bytes"]
    c = st.columns(6)
    c[0].metric("Sequences complete", f"{info['complete']} / {info['total']}")
    c[1].metric("Tokens per sequence", ctx.length)
    c[2].metric("Layers captured", f"{len(ctx.layers)} / {cfg.get('num_hidden_layers', '?')}")
    c[3].metric("Heads × steps", f"{ctx.n_heads} × {ctx.n_h}")
    c[4].metric("dk × dv", f"{ds.sizes.get('dk', '?')} × {ds.sizes.get('dv', '?')}")
    c[5].metric("On disk", human_bytes(stored))
    if info["total"]:
        st.progress(info["complete"] / info["total"],
                    text=f"{info['complete']} of {info['total']} sequences complete"
                         + ("" if info["complete"] == info["total"] else
                            " — the capture did not finish: rerun its command to resume"))

    _findings(ctx)
    left, right = st.columns([3, 2])
    with left:
        st.subheader("Model")
        ckpt = ctx.checkpoint
        n_params = param_count(ckpt) if ckpt is not None else None
        st.markdown(f"**{markdown_text(model_summary(cfg, n_params))}**")
        notes = []
        if ckpt is not None:
            notes.append(f"checkpoint {code_text(ckpt)}")
        notes.append(f"digest {code_text(str(attrs.get('checkpoint_digest', '?'))[:23] + '…')}")
        st.caption(" · ".join(notes))
        card = readme(ckpt)
        if card:  # the checkpoint's text, shown as written: its markdown (images, links) is not rendered
            with st.expander("Model card (README.md of the checkpoint, as text)", expanded=True):
                st.text(card)
        with st.expander("Full model config"):
            st.text(json.dumps(cfg, indent=1, default=str))  # plain text, no highlighter to load on the first page
    with right:
        st.subheader("Capture provenance")
        segs = attrs.get("segments") or []
        rows = [("created", attrs.get("created")), ("deltalab version", attrs.get("deltalab_version")),
                ("data", attrs.get("data_spec")), ("hooks", ", ".join(attrs.get("hooks") or [])),
                ("layers", ", ".join(map(str, attrs.get("layers") or []))), ("dtype", attrs.get("dtype")),
                ("batch size", attrs.get("batch_size")), ("chunk size (state boundaries)", attrs.get("chunk_size")),
                ("training length", attrs.get("train_length", "unknown")),
                ("processes", attrs.get("world_size", 1))]
        st.markdown("| field | value |\n|---|---|\n" + "\n".join(f"| {k} | {_cell(v)} |" for k, v in rows))
        st.text(" ".join(map(str, attrs.get("command_line") or [])))
        if len(segs) > 1:
            st.table(pd.DataFrame(table_rows([{"data spec": str(s.get("data_spec")), "first seq": s.get("start"),
                                               "count": s.get("count")} for s in segs])), hide_index=True)

    st.subheader("Variables")
    var = info["variables"]
    export.chart(figures.variable_sizes([v["variable"] for v in var], [v["in memory"] for v in var],
                                        [v["on disk"] for v in var]), key="ov_sizes")
    st.table(pd.DataFrame(table_rows([{**v, "in memory": human_bytes(v["in memory"]),
                                       "on disk": human_bytes(v["on disk"])} for v in var])), hide_index=True)

    st.subheader("Probe results")
    index = loading.result_index(str(ctx.path))
    rows = []
    for probe in PROBES:
        groups = [n for n, r in index.items() if r["probe"] == probe]
        if not groups:
            rows.append({"probe": probe, "results": "—", "status": "not run",
                         "command": loading.probe_command(probe, ctx.path, ctx.checkpoint)})
        for n in groups:
            r = index[n]
            rows.append({"probe": probe, "results": f"results/{n}",
                         "status": "complete" if r["complete"] else "incomplete (rerun the probe)",
                         "command": f"created {r['created']}, {r['n_seq']} sequences"})
    rows = table_rows(rows)
    # static tables: the first page skips loading the interactive data-grid component (about 0.6 s in a browser)
    st.table(pd.DataFrame(rows).rename(columns={"command": "details / command"}), hide_index=True)
    if not index:
        st.info("**No probe results in this store yet.** The Betas, Keys and Spectra pages show previews from the "
                "first sequences; for the full analyses run:\n\n```\n"
                + "\n".join(loading.probe_command(p, ctx.path).replace("`", "'") for p in PROBES[:-1]) + "\n```")
    with st.expander("All root attributes (JSON)"):
        st.text(json.dumps({k: v for k, v in attrs.items() if k != "model_config"}, indent=1, default=str))
