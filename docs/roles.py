"""A griffe extension for the API reference: shoal's docstrings use Sphinx roles (:class:`X`,
:mod:`x`, :meth:`~x.Y.z`) and double backticks, which Markdown would print as they are; this turns
them into code spans (the last dotted name where a ``~`` asks for it)."""

from __future__ import annotations

import re

import griffe

ROLE = re.compile(r":(?:class|mod|meth|func|attr|data|exc|obj):`(~?)([^`]+)`")


def _span(match: re.Match) -> str:
    name = match.group(2)
    return f"`{name.rsplit('.', 1)[-1] if match.group(1) else name}`"


class SphinxRoles(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(_span, obj.docstring.value).replace("``", "`")
