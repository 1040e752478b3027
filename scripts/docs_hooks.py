"""MkDocs hook (mkdocs.yml's ``hooks``): the docstrings' Sphinx roles (``:func:`x```,
``:class:`~a.B```), which mkdocstrings leaves as text, shown as the code they name; and
the images BENCHMARKS.md shows from ``docs/`` (right on GitHub, where it is read from the
repository's root) found from the page that includes it; and the report's findings,
listed where a page says ``<!-- findings -->``, from each pattern's own one-line doc."""

from __future__ import annotations

import re

_ROLE = re.compile(r":(?:func|class|meth|mod|attr|data|exc|obj):(<code>)~?")


def on_page_content(html: str, page, **kwargs: object) -> str:
    up = "../" * page.url.count("/")
    return _ROLE.sub(r"\1", html).replace('src="docs/', f'src="{up}')


def on_page_markdown(markdown: str, **kwargs: object) -> str:
    if "<!-- findings -->" not in markdown:
        return markdown
    from xpuruntime.pytorch._optimize import patterns

    rows = [f"| `{f.field}` | {f.doc.replace('``', '`')} |" for f in patterns.FINDINGS]
    table = "\n".join(["| report field | what it lists |", "| --- | --- |", *rows])
    return markdown.replace("<!-- findings -->", table)
