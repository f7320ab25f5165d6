"""Plain text out of the markup formats the sources ship: DocBook HTML, GNU Info, man (groff).

Owns: `html_to_text` (block structure kept as paragraphs, navigation chrome dropped, <pre> verbatim),
`info_nodes` (a GNU Info file split into its nodes), `render_man` (a man page rendered by groff to
ASCII, overstrike off). All return text that still has to go through `document.normalise_text`.

Does not own: which files are read (`sources`).
"""
from __future__ import annotations

import gzip
import re
import subprocess
from html.parser import HTMLParser
from pathlib import Path

__all__ = ["html_to_text", "info_nodes", "render_man", "man_is_redirect"]

_BLOCK = {"p", "div", "br", "h1", "h2", "h3", "h4", "h5", "h6", "li", "dt", "dd", "tr", "table", "pre",
          "blockquote", "ul", "ol", "dl", "hr", "title", "caption"}
_SKIP_TAGS = {"script", "style", "head"}
# DocBook XSL chrome: navigation bars, tables of contents, screenshots.
_SKIP_CLASSES = {"navheader", "navfooter", "toc", "list-of-figures", "list-of-tables", "mediaobject"}


class _HtmlText(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.out: list[str] = []
        self.stack: list[tuple[str, bool]] = []    # (tag, starts a skipped subtree)
        self.skip = 0
        self.pre = 0

    def handle_starttag(self, tag, attrs):
        classes = set((dict(attrs).get("class") or "").split())
        skipping = tag in _SKIP_TAGS or bool(classes & _SKIP_CLASSES)
        if tag not in ("br", "hr", "img", "meta", "link", "input"):
            self.stack.append((tag, skipping))
            self.skip += skipping
        if tag == "pre":
            self.pre += 1
        if tag in _BLOCK and not self.skip:
            self.out.append("\n\n" if tag != "br" else "\n")
        if tag == "li" and not self.skip:
            self.out.append("- ")

    def handle_endtag(self, tag):
        # close up to the matching open tag; DocBook output is well formed, this tolerates stray ends
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i][0] == tag:
                for _, skipping in self.stack[i:]:
                    self.skip -= skipping
                del self.stack[i:]
                break
        if tag == "pre":
            self.pre = max(0, self.pre - 1)
        if tag in _BLOCK and not self.skip:
            self.out.append("\n\n")

    def handle_data(self, data):
        if self.skip:
            return
        if not self.pre:
            data = re.sub(r"\s+", " ", data)
            if not self.out or self.out[-1].endswith("\n"):
                data = data.lstrip()
        self.out.append(data)


def html_to_text(html: str) -> str:
    p = _HtmlText()
    p.feed(html)
    p.close()
    text = "".join(p.out)
    text = re.sub(r"[ \t]*\n(?:[ \t]*\n)+", "\n\n", text)   # paragraph breaks; <pre> keeps its indentation
    text = re.sub(r"(^|\n)- *\n\n", r"\1- ", text)          # list bullet followed by its paragraph
    return text.strip()


_INFO_HEADER = re.compile(r"^File: [^,]+,\s+Node: ([^,\n]+)", re.M)


def info_nodes(path: Path) -> list[tuple[str, str]]:
    """(node name, text) for every node of a (possibly gzipped) Info file, in file order."""
    raw = Path(path).read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    nodes = []
    for chunk in raw.decode("utf-8").split("\x1f\n")[1:]:
        m = _INFO_HEADER.match(chunk)
        if not m:               # tag table, indirect table, local variables
            continue
        body = chunk[m.end():].split("\n", 1)[1] if "\n" in chunk[m.end():] else ""
        nodes.append((m.group(1).strip(), body))
    return nodes


def man_is_redirect(source: str) -> bool:
    """A page that is only a `.so` include of another page."""
    lines = [ln for ln in source.splitlines() if ln.strip() and not ln.startswith(('.\\"', "'\\\"", '.\\\\"'))]
    return len(lines) <= 2 and any(ln.startswith(".so ") for ln in lines)


def render_man(source: bytes) -> str:
    """Render one man page with groff: tbl, ASCII device, no overstrike, ragged right, no hyphenation.

    Left adjustment (`.ad l`, prepended: groff 1.22 has no AD string) and `-rHY=0` keep words whole
    and single-spaced, instead of justified lines that pad with extra spaces and split words.
    """
    run = subprocess.run(["groff", "-t", "-man", "-Tascii", "-P", "-cbou", "-rLL=78n", "-rHY=0"],
                         input=b".ad l\n" + source,
                         capture_output=True, env={"PATH": "/usr/bin:/bin", "LC_ALL": "C"})
    return run.stdout.decode("ascii", errors="replace")
