"""Checks of the PNG charts the bench (bench/plots.py) and the demo (demo/plot.py) write: the
pixel size they were drawn at, and that something was drawn on them (not a blank canvas)."""

from __future__ import annotations

from pathlib import Path

# A chart at 100 dpi is about a million pixels, of which the text alone of a chart that says
# "no rows" inks about 1%; a blank or nearly blank canvas inks none.
MIN_INK = 0.005  # fraction of pixels that differ from the background (the most common colour)
MIN_COLOURS = 8  # antialiased text alone brings dozens of greys


def png_problems(path: Path, width: int | None = None, min_height: int = 300, max_bytes: int = 200_000) -> list[str]:
    """What is wrong with the PNG at `path` (empty when nothing is): not a PNG, not `width`
    pixels wide, under `min_height` tall, over `max_bytes`, too few colours or too little ink."""
    from PIL import Image  # matplotlib's own dependency

    problems = []
    with Image.open(path) as image:
        if image.format != "PNG":
            problems.append(f"{path.name} is {image.format}, not PNG")
        if width is not None and image.width != width:
            problems.append(f"{path.name} is {image.width} px wide, expected {width}")
        if image.height < min_height:
            problems.append(f"{path.name} is {image.height} px tall, expected at least {min_height}")
        pixels = image.convert("RGB")
    if path.stat().st_size > max_bytes:
        problems.append(f"{path.name} takes {path.stat().st_size:,} bytes, more than {max_bytes:,}")
    colours = pixels.getcolors(maxcolors=pixels.width * pixels.height) or []
    background = max(colours)[0] if colours else 0
    ink = 1 - background / (pixels.width * pixels.height)
    if len(colours) < MIN_COLOURS or ink < MIN_INK:
        problems.append(f"{path.name} looks blank: {len(colours)} colours, {ink:.2%} of pixels off the background")
    return problems


def pixels_near(path: Path, colour: str, tolerance: int = 24) -> int:
    """Pixels of the PNG within `tolerance` (per channel) of `colour` ('#rrggbb')."""
    from PIL import Image

    target = tuple(int(colour[i : i + 2], 16) for i in (1, 3, 5))
    with Image.open(path) as image:
        colours = image.convert("RGB").getcolors(maxcolors=image.width * image.height) or []
    return sum(n for n, rgb in colours if all(abs(a - b) <= tolerance for a, b in zip(rgb, target, strict=True)))
