"""mkdocs hook (mkdocs.yml ``hooks:``): the docstrings' Sphinx roles shown as code.

The docstrings use Sphinx roles (``:func:`~powersgd_triton.checkpoint.save_hook_state```), which mkdocstrings'
Google-style parser leaves as text: ``:func:`` before a code span. This drops the role and, for a ``~`` target, keeps
the last component, as Sphinx shows it.
"""

import re

_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj|const):(<code>)(~?)([^<]*)(</code>)")


def _shown(m: "re.Match") -> str:
    target = m.group(3)
    if m.group(2):
        target = target.rsplit(".", 1)[-1]
    return f"{m.group(1)}{target}{m.group(4)}"


def on_page_content(html, page, config, files):  # noqa: D103 - mkdocs' hook signature
    return _ROLE.sub(_shown, html)
