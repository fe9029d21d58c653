"""Store and checkpoint strings shown as text in the dashboard, never as markdown.

Streamlit renders markdown (and `$...$` maths, `:color[...]` directives) in st.markdown, st.caption, st.info,
st.table cells and titles. A store's attributes are written by whoever made the store: `![x](http://host/p.png)`
in a data spec would become an image the browser fetches. `markdown_text` escapes every markdown character so the
value reads exactly as stored.
"""

from __future__ import annotations

import re
from typing import Any

from deltalab.store.display import inert

_SPECIAL = re.compile(r"([\\`*\[\]#!|<>~$:&]|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9]))")
"""Characters markdown (CommonMark, GFM tables and autolinks, Streamlit's `:color[...]` directives and `$` maths)
can give meaning to mid-line: without an unescaped `[` no link or image forms, without `<` no autolink or tag,
without `:` no directive or bare URL. An underscore inside a word (`n_h`) never delimits emphasis and is left;
newlines are escaped (store.display.inert), so line-start syntax (`#`, `-`, `1.`) cannot occur mid-value."""


def markdown_text(value: Any, limit: int | None = 2000) -> str:
    """`value` as markdown that renders to its own characters: punctuation backslash-escaped, control characters
    and newlines shown as escapes (store.display.inert), cut to `limit` characters (None: no cut)."""
    text = inert(value)
    if limit is not None and len(text) > limit:
        text = text[:limit] + "…"
    text = _SPECIAL.sub(r"\\\1", text)
    text = re.sub(r"^(\s*)([-+=])", r"\1\\\2", text)  # a value that begins a block: no list, rule or heading
    return re.sub(r"^(\s*\d+)([.)])", r"\1\\\2", text)


def code_text(value: Any, limit: int | None = 2000) -> str:
    """`value` inside a markdown code span (backticks in it cannot close the span: they are replaced)."""
    text = inert(value)
    if limit is not None and len(text) > limit:
        text = text[:limit] + "…"
    return "`" + text.replace("`", "'") + "`"


def table_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows for st.table (which renders markdown in its cells) with every string cell and key escaped."""
    return [{markdown_text(k): markdown_text(v) if isinstance(v, str) else v for k, v in row.items()} for row in rows]
