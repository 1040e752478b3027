"""MkDocs hook (mkdocs.yml's ``hooks``): the docstrings' Sphinx roles (``:func:`x```,
``:class:`~a.B```), which mkdocstrings leaves as text, shown as the code they name."""

from __future__ import annotations

import re

_ROLE = re.compile(r":(?:func|class|meth|mod|attr|data|exc|obj):(<code>)~?")


def on_page_content(html: str, **kwargs: object) -> str:
    return _ROLE.sub(r"\1", html)
