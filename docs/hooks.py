"""MkDocs hooks (mkdocs.yml `hooks:`): fill the generated reference parts in, and turn links to
repository files outside docs/ into links the site can hold.

The pages link to files such as `../../protos/weightserver/v1/weights.proto` relative to where
they sit, so the links work when GitHub shows docs/. The built site has no such files: with
`repo_url` set the link goes to the file there, else it becomes the path as text. A target that
does not exist in the repository is a warning, which `mkdocs build --strict` makes an error.
"""

from __future__ import annotations

import importlib.util
import logging
import posixpath
import re
import sys
from pathlib import Path

log = logging.getLogger("mkdocs.hooks.weightserver")
HERE = Path(__file__).resolve().parent
LINK = re.compile(r"(?<!!)\[(?P<text>[^\]]+)\]\((?P<target>[^)\s]+)\)")


def _reference_pages():
    """docs/reference_pages.py, imported by path (docs/ is no package), documenting the code of
    this checkout (its root and client/ go first on sys.path, as mkdocstrings' `paths` say)."""
    name = "weightserver_docs_reference_pages"
    if name not in sys.modules:
        for path in (HERE.parent / "client", HERE.parent):
            if str(path) not in sys.path:
                sys.path.insert(0, str(path))
        spec = importlib.util.spec_from_file_location(name, HERE / "reference_pages.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def repository_links(markdown: str, page_path: str, repo_root: Path, repo_url: str | None) -> tuple[str, list[str]]:
    """`markdown` with links that leave docs/ rewritten; also the targets that do not exist."""
    missing: list[str] = []

    def rewrite(match: re.Match[str]) -> str:
        target = match["target"]
        if re.match(r"^[a-z][a-z0-9+.-]*:|^#|^/", target):  # a URL, an anchor, an absolute path
            return match[0]
        path, _, anchor = target.partition("#")
        inside = posixpath.normpath(posixpath.join(posixpath.dirname(page_path), path))
        if not inside.startswith("../"):
            return match[0]  # a page or file of the site: MkDocs checks it
        in_repo = posixpath.normpath(posixpath.join("docs", inside))
        if not (repo_root / in_repo).exists():
            missing.append(in_repo)
        if repo_url:
            return f"[{match['text']}]({repo_url.rstrip('/')}/blob/main/{in_repo}{'#' + anchor if anchor else ''})"
        text = match["text"]
        return text if text.strip("`") == in_repo else f"{text} (`{in_repo}`)"

    out, fenced = [], False
    for line in markdown.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        out.append(line if fenced else LINK.sub(rewrite, line))
    return "\n".join(out), missing


def on_page_markdown(markdown, page, config, files, **kwargs):
    markdown = _reference_pages().expand(markdown)
    repo_root = Path(config["config_file_path"]).resolve().parent
    markdown, missing = repository_links(markdown, page.file.src_uri, repo_root, config.get("repo_url"))
    for target in missing:
        log.warning("Doc file '%s' links to '%s', which is not in the repository.", page.file.src_uri, target)
    return markdown
