"""The Overview opens on findings: for each probe that has run, the head that stands out (the planted store's
layer 0 head 0 reflects with β = 2), the number that makes it stand out, and a link to its page."""

from __future__ import annotations

from tests.app.stores import probed_store
from tests.app.test_pages import assert_clean, new_app


def test_overview_names_the_planted_head_and_links_to_its_page(monkeypatch, tmp_path_factory):
    at = new_app(monkeypatch, probed_store(tmp_path_factory))
    at.run()
    assert_clean(at)
    assert any(s.value == "Findings" for s in at.subheader)
    lines = [m.value for m in at.markdown if m.value.startswith("**betas** ·")]
    assert lines and lines[0].startswith("**betas** · layer 0 head 0:"), lines
    assert "100% of its sub-steps have β > 1" in lines[0], lines
    assert any(m.value.startswith("**erank** ·") for m in at.markdown)
    at.button(key="finding_0").click().run()
    assert_clean(at)
    assert at.session_state["page"] == "Betas" and at.title[0].value == "Betas"
    assert at.session_state["sel_layer"] == 0 and at.session_state["sel_head"] == 0
