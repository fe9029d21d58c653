"""The dashboard opens only what its user chose, and shows store strings as text.

A crafted link (`?store=`, `?cmp_store=`, `?page=Input&input_checkpoint=...&input_text=...`) opens nothing outside
the dashboard's roots, says so in words that do not tell whether the path exists, and runs no model until Run is
pressed; markdown planted in a store's attributes is shown as its characters (no <img>, no link)."""

from __future__ import annotations

import html
import re
import shutil
from pathlib import Path

import pytest
import zarr
from markdown_it import MarkdownIt

from deltalab.app.dash import own_input, roots
from deltalab.probes.synthetic import write_synthetic_store

pytest.importorskip("streamlit")
from tests.app.test_pages import assert_clean, new_app  # noqa: E402

FIXTURE = Path(__file__).parents[1] / "fixtures" / "fla" / "gdp_nh2_all"
PLANT = "![x](http://evil.example/p.png) [click](javascript:alert(1)) <img src=x> $x$ :red[y]"
_MD = MarkdownIt("commonmark").enable("table")


@pytest.fixture(scope="module")
def place(tmp_path_factory):
    """started/s.zarr (the server's store), elsewhere/o.zarr (a real store outside the roots), a decoy checkpoint
    outside the roots, and allowed/a.zarr under a root given with --root."""
    base = tmp_path_factory.mktemp("links")
    made = {}
    for key, rel in (("started", "started/s.zarr"), ("outside", "elsewhere/o.zarr"), ("allowed", "allowed/a.zarr")):
        made[key] = write_synthetic_store(base / rel, n_seq=2, length=16, n_layers=1, n_heads=4, batch_size=2, seed=5)
    made["checkpoint"] = Path(shutil.copytree(FIXTURE, base / "elsewhere" / "ckpt"))
    made["base"] = base
    return made


@pytest.fixture
def no_model(monkeypatch):
    """Record every model load the dashboard attempts."""
    calls = []

    def record(checkpoint, device="cpu"):
        calls.append(str(checkpoint))
        raise RuntimeError("no model in this test")

    monkeypatch.setattr(own_input, "get_model", record)
    monkeypatch.setattr(own_input, "load_model", record)
    return calls


def _texts(at) -> list[str]:
    """Everything the page shows as markdown (titles, captions, boxes, sidebar), as source."""
    out = []
    for kind in ("title", "markdown", "caption", "warning", "info", "error", "success", "subheader", "header"):
        out += [str(e.value) for e in at.get(kind)]
    out += [str(e.value) for e in at.sidebar.get("caption")]
    return out


def test_a_link_to_a_store_outside_the_roots_opens_nothing_and_reveals_nothing(monkeypatch, place):
    shown = []
    for target in (place["outside"], place["base"] / "elsewhere" / "nothing-here.zarr", Path("/etc")):
        at = new_app(monkeypatch, place["started"])
        at.query_params["store"] = str(target)
        at.run()
        assert not at.exception, [e.message for e in at.exception]
        assert any(str(place["started"]) in c.value for c in at.sidebar.caption)  # still the started store
        assert not any(str(target) in t for t in _texts(at))
        warnings = [w.value for w in at.warning]
        assert warnings == [roots.REFUSED_STORE]
        shown.append((warnings, [t.value for t in at.title]))
    assert shown[0] == shown[1] == shown[2]  # an existing store, a missing path and a system folder read alike


def test_a_link_under_a_given_root_opens(monkeypatch, place):
    at = new_app(monkeypatch, place["started"], DELTALAB_ROOTS=str(place["allowed"].parent))
    at.query_params["store"] = str(place["allowed"])
    at.run()
    assert_clean(at)
    assert any(str(place["allowed"]) in c.value for c in at.sidebar.caption) and not at.warning


def test_a_link_with_a_checkpoint_and_input_loads_nothing_until_run(monkeypatch, place, no_model):
    at = new_app(monkeypatch, place["started"])
    at.query_params["page"] = "Input"
    at.query_params["input_checkpoint"] = str(place["checkpoint"])
    at.query_params["input_text"] = "1 0 1 1"
    at.run()
    assert not at.exception, [e.message for e in at.exception]
    assert at.text_input(key="input_checkpoint").value == ""  # the store's own (a synthetic store has none)
    assert roots.REFUSED_CHECKPOINT in [w.value for w in at.warning]
    assert any("This link carries an input" in i.value for i in at.info)
    assert not at.get("plotly_chart")
    assert no_model == []  # nothing loaded, nothing run
    at.button(key="input_run").click().run()  # the reader's click: now the page runs (and says what is missing)
    assert any("no checkpoint at (empty)" in e.value for e in at.error)
    assert no_model == []


def test_a_typed_checkpoint_is_the_readers_choice(monkeypatch, place, no_model):
    at = new_app(monkeypatch, place["started"])
    at.query_params["page"] = "Input"
    at.run()
    at.text_input(key="input_checkpoint").set_value(str(place["checkpoint"])).run()
    at.text_area(key="input_text").set_value("1 0 1").run()
    at.button(key="input_run").click().run()
    assert str(place["checkpoint"]) in no_model  # typed in this browser session: loaded on Run


def test_a_compare_link_to_a_store_outside_the_roots_is_refused(monkeypatch, place):
    at = new_app(monkeypatch, place["started"])
    at.query_params["page"] = "Compare"
    at.query_params["cmp_mode"] = "two stores"
    at.query_params["cmp_store"] = str(place["outside"])
    at.run()
    assert not at.exception, [e.message for e in at.exception]
    assert roots.REFUSED_STORE in [w.value for w in at.warning]
    assert at.text_input(key="cmp_store").value == ""


@pytest.fixture(scope="module")
def planted(place, tmp_path_factory):
    path = Path(shutil.copytree(place["started"], tmp_path_factory.mktemp("planted") / "p.zarr"))
    group = zarr.open_group(str(path), mode="r+", zarr_format=3)
    group.attrs.update({"data_spec": PLANT, "created": PLANT,
                        "deltalab_version": "**bold** \x1b[31mred\x1b[0m <script>alert(1)</script>",
                        "command_line": ["deltalab", "capture", "\x1b]0;owned\x07", PLANT]})
    return path


def test_planted_markdown_is_shown_as_text_in_the_overview(monkeypatch, planted):
    at = new_app(monkeypatch, planted)
    at.run()
    assert not at.exception, [e.message for e in at.exception]
    sources = _texts(at) + [str(v) for t in at.get("table") for v in t.value.to_numpy().ravel()]
    rendered = "\n".join(_MD.render(s) for s in sources)
    assert "evil.example" in html.unescape(re.sub(r"<[^>]+>", "", rendered))  # the value is shown ...
    assert "<img" not in rendered and "<a " not in rendered and "<strong>bold" not in rendered  # ... as text
    assert "<script" not in rendered


def test_store_info_shows_escape_sequences_inert(planted):
    from typer.testing import CliRunner

    from deltalab.app.cli import app

    res = CliRunner().invoke(app, ["store", "info", str(planted)])
    assert res.exit_code == 0, res.output
    assert "\x1b" not in res.stdout and "\x07" not in res.stdout
    assert "\\x1b]0;owned\\x07" in res.stdout and "\\x1b[31mred" in res.stdout


def test_an_error_line_shows_escape_sequences_inert(tmp_path):
    from typer.testing import CliRunner

    from deltalab.app.cli import app

    res = CliRunner().invoke(app, ["store", "info", str(tmp_path / "x\x1b[2Jy")])
    assert res.exit_code == 2
    assert "\x1b" not in res.stderr and "x\\x1b[2Jy" in res.stderr
