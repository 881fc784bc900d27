"""MkDocs hook: links from the documentation into the rest of the repository.

The pages link to source files, charts and schemas by relative path (``../../deploy/``),
so they read right where the repository is browsed (a forge, an editor). The site has no
copy of those files and no known forge URL, so MkDocs would report every such link as
"not found". This hook checks each one against the repository instead: a target that
exists becomes its repository path in code (the link text kept), one that does not is a
warning, which ``mkdocs build --strict`` turns into a failed build.
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path
from typing import Any

log = logging.getLogger("mkdocs.plugins.crs_repo_links")

# [text](target) outside code; an image's ! is left alone (the site has none).
_LINK = re.compile(r"(?<!!)\[([^\]]+)\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    docs_dir = Path(config["docs_dir"]).resolve()
    repo = Path(config["config_file_path"]).resolve().parent
    page_dir = posixpath.dirname(page.file.src_uri)

    def rewrite(match: re.Match[str]) -> str:
        text, target = match.group(1), match.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            return match.group(0)
        path = target.split("#", 1)[0]
        resolved = (docs_dir / page_dir / path).resolve()
        if resolved.is_relative_to(docs_dir):
            return match.group(0)  # a page of the site: MkDocs validates it
        if not resolved.is_relative_to(repo):
            log.warning("%s: link %s leaves the repository", page.file.src_uri, target)
            return match.group(0)
        if not resolved.exists():
            log.warning("%s: link %s: no such file in the repository", page.file.src_uri, target)
            return match.group(0)
        shown = resolved.relative_to(repo).as_posix() + ("/" if resolved.is_dir() else "")
        if text.strip("`") == shown.rstrip("/") or text.strip("`") == shown:
            return f"`{shown}`"
        return f"{text} (`{shown}`)"

    # Fenced code keeps its text; links are rewritten only between the fences.
    out, last = [], 0
    for fence in _FENCE.finditer(markdown):
        out.append(_LINK.sub(rewrite, markdown[last : fence.start()]))
        out.append(fence.group(0))
        last = fence.end()
    out.append(_LINK.sub(rewrite, markdown[last:]))
    return "".join(out)
