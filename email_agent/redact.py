"""Secrets out of anything this project shows: log lines, reports, traces.

An API error can quote the request that failed, key included, and a report renders model output that may
repeat it. `redact` removes the values of the keys in use (given, or in any *_API_KEY / *_TOKEN / *_SECRET
environment variable: OPENAI_API_KEY, JUDGE_API_KEY, a provider's own) and anything shaped like a key.
"""

from __future__ import annotations

import os
import re

KEY_SHAPES = [(re.compile(r"sk-[A-Za-z0-9_-]{8,}"), "sk-[redacted]"), (re.compile(r"Bearer \S+"), "Bearer [redacted]")]
SECRET_VARIABLE = re.compile(r"(API_KEY|TOKEN|SECRET)$")
MIN_SECRET_LENGTH = 8  # shorter values ("none", "x") are placeholders, and replacing them would garble text


def redact(text, *secrets: str | None) -> str:
    text = "" if text is None else str(text)
    values = {s for s in secrets if s} | {v for k, v in os.environ.items() if SECRET_VARIABLE.search(k.upper())}
    for value in sorted((v for v in values if len(v) >= MIN_SECRET_LENGTH), key=len, reverse=True):
        text = text.replace(value, "[redacted]")
    for shape, replacement in KEY_SHAPES:
        text = shape.sub(replacement, text)
    return text
