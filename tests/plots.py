"""Reading back the plots the assets put in their Markdown metadata."""

from __future__ import annotations

import base64
import io
import re

from PIL import Image

PLOT_SIZE = (540, 288)  # 6.0 x 3.2 inches at 90 dpi


def decode_plot(markdown: object) -> Image.Image:
    """The PNG inside `![alt](data:image/png;base64,...)` (a string or a Markdown metadata
    value), decoded; fails if there is none."""
    markdown = str(getattr(markdown, "value", markdown))
    match = re.fullmatch(r"!\[[^\]]*\]\(data:image/png;base64,([A-Za-z0-9+/=]+)\)", markdown)
    assert match, f"not a Markdown PNG: {markdown[:80]!r}"
    image = Image.open(io.BytesIO(base64.b64decode(match.group(1))))
    image.load()
    return image
