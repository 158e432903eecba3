"""Turning real exported messages (Gmail, Thunderbird, Outlook, Apple Mail) into plain text.

Owns: decoding headers (RFC 2047 encoded words, raw 8-bit bytes), choosing a message's body among its MIME
parts (text/plain preferred, HTML turned into text, attachments skipped), and decoding bytes in whatever
charset the message claims, including wrong or unknown ones. `sources.message_to_record` uses it; it knows
nothing of the database.

HTML is turned into text with the standard library's html.parser (no new dependency): enough for search
and for a model to read (paragraphs, line breaks, list items, table rows, link text), not a renderer.
"""

from __future__ import annotations

import email.errors
import email.header
import email.message
import re
from html.parser import HTMLParser

FALLBACK_CHARSET = "cp1252"  # what undeclared 8-bit mail from Windows clients (Outlook, Enron) usually is


def decode_bytes(payload: bytes, charset: str | None) -> str:
    """Bytes in the declared charset; else UTF-8; else cp1252 with replacement characters. Never raises."""
    for candidate in (charset, "utf-8"):
        if candidate:
            try:
                return payload.decode(candidate.strip().strip('"'))
            except (LookupError, UnicodeDecodeError):  # an unknown charset name, or mail mislabelled
                continue
    return payload.decode(FALLBACK_CHARSET, errors="replace")


def decode_header(value) -> str:
    """A header as text: RFC 2047 encoded words decoded (any charset, bad names tolerated), raw 8-bit bytes too."""
    if value is None:
        return ""
    if isinstance(value, str):
        if "=?" not in value:
            return value
    try:
        chunks = email.header.decode_header(value)
    except email.errors.HeaderParseError:
        return str(value)
    return "".join(chunk if isinstance(chunk, str) else decode_bytes(chunk, charset) for chunk, charset in chunks)


def _is_attachment(part: email.message.Message) -> bool:
    disposition = (part.get("Content-Disposition") or "").split(";")[0].strip().lower()
    return disposition == "attachment" or (disposition != "inline" and part.get_filename() is not None)


def _leaf_parts(msg: email.message.Message):
    """Inline leaf parts in order; attachments and attached messages (forwarded .eml) are skipped."""
    if _is_attachment(msg) or msg.get_content_type() == "message/rfc822":
        return
    if msg.is_multipart():
        subparts = msg.get_payload()
        if msg.get_content_type() == "multipart/alternative":  # one body in several forms: take the plainest
            plain = [p for p in subparts if p.get_content_type() == "text/plain"]
            subparts = plain[-1:] or subparts[-1:]
        for sub in subparts:
            yield from _leaf_parts(sub)
    else:
        yield msg


def _content_type(part: email.message.Message) -> str:
    """A leaf's type; a "multipart" leaf is one whose boundary is missing (the parser could not split it), and its
    payload is read as the plain text it most likely is rather than lost."""
    return "text/plain" if part.get_content_maintype() == "multipart" else part.get_content_type()


def message_body(msg: email.message.Message) -> str:
    """The text of a message: its inline text/plain parts, or its HTML parts as text when it has no plain ones."""
    parts = [p for p in _leaf_parts(msg) if _content_type(p).startswith("text/")]
    plain = [p for p in parts if _content_type(p) == "text/plain"]
    html = [p for p in parts if _content_type(p) == "text/html"]
    texts = []
    for part in plain or html:
        payload = part.get_payload(decode=True) or b""
        text = decode_bytes(payload, part.get_content_charset())
        texts.append(text if plain else html_to_text(text))
    return "\n\n".join(t.strip("\n") for t in texts if t.strip())


# ----------------------------------------------------------------------------------------------
# HTML -> text
# ----------------------------------------------------------------------------------------------

_BLOCK = {"p", "div", "br", "tr", "li", "ul", "ol", "table", "blockquote", "h1", "h2", "h3", "h4", "h5", "h6",
          "hr", "pre", "section", "article", "header", "footer", "dt", "dd"}
_HIDDEN = {"script", "style", "head", "title", "template"}


class _TextExtractor(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.out: list[str] = []
        self.hidden = 0

    def handle_starttag(self, tag, attrs):
        if tag in _HIDDEN:
            self.hidden += 1
        elif tag in _BLOCK:
            self.out.append("\n- " if tag == "li" else "\n")
        elif tag in ("td", "th"):
            self.out.append(" ")

    def handle_startendtag(self, tag, attrs):
        if tag in _BLOCK:
            self.out.append("\n")

    def handle_endtag(self, tag):
        if tag in _HIDDEN:
            self.hidden = max(0, self.hidden - 1)
        elif tag in _BLOCK and tag not in ("br", "li"):
            self.out.append("\n")

    def handle_data(self, data):
        if not self.hidden:
            self.out.append(data)


def html_to_text(html: str) -> str:
    parser = _TextExtractor()
    parser.feed(html)
    parser.close()
    text = "".join(parser.out).replace("\xa0", " ")
    lines = [" ".join(line.split()) for line in text.split("\n")]  # HTML whitespace is not meaningful
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()
