"""The manual's pictures of the viewer and the Temporal Web UI (docs/images/), taken by the
integration suite's real browser (Debian's Chromium through Playwright) on a real stack, so they
show the pages as the code draws them today. Each is one laptop-sized viewport, kept small."""

from __future__ import annotations

import io
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from playwright.async_api import Page, async_playwright

CHROMIUM = Path("/usr/bin/chromium")
IMAGES = Path(__file__).resolve().parents[2] / "docs" / "images"
VIEWPORT = {"width": 1280, "height": 800}


@asynccontextmanager
async def browser_page() -> AsyncIterator[Page]:
    """A page of a headless Chromium, one laptop screen in size."""
    if not CHROMIUM.exists():
        pytest.fail("Debian's chromium is missing: `make test` installs it (apt-get)")
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=["--no-sandbox"], timeout=60_000
        )
        try:
            page = await browser.new_page(viewport=VIEWPORT)  # type: ignore[arg-type]
            page.set_default_timeout(30_000)
            yield page
        finally:
            await browser.close()


async def save_screenshot(page: Page, name: str) -> Path:
    """The page's viewport as docs/images/<name>.png, in 256 colours when Pillow is there: a
    screen of text and flat colours loses nothing a reader sees, and the file shrinks."""
    png = await page.screenshot()
    try:
        from PIL import Image
    except ImportError:
        small = png
    else:
        out = io.BytesIO()
        image = Image.open(io.BytesIO(png)).convert("RGB")
        image.quantize(colors=256, method=Image.Quantize.FASTOCTREE).save(
            out, format="PNG", optimize=True
        )
        small = out.getvalue()
    IMAGES.mkdir(parents=True, exist_ok=True)
    path = IMAGES / f"{name}.png"
    path.write_bytes(small)
    return path
