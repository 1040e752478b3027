"""Inputs like the ones real models see, made here without downloads: text rendered into
images for the OCR models (detector pages, recognizer and classifier text lines) and
speech-like audio. Used by the int8 tests and by benchmarks/bench_cpu_speed.py."""

from __future__ import annotations

import numpy as np

WORDS = (
    "invoice total amount due date payment reference number customer account balance "
    "tax shipping order quantity price description item delivery address phone"
).split()


def _font(size: int):
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: one bitmap size
        return ImageFont.load_default()


def _normalised(image) -> np.ndarray:
    """PP-OCR's preprocessing: RGB in [-1, 1], NCHW."""
    array = np.asarray(image).astype(np.float32) / 255.0
    return ((array - 0.5) / 0.5).transpose(2, 0, 1)[None].copy()


def text_page(seed: int, height: int = 640, width: int = 640) -> np.ndarray:
    """A page of printed lines (PP-OCR detector input, 1x3xHxW)."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    image = Image.new("RGB", (width, height), tuple(int(v) for v in rng.integers(200, 256, 3)))
    draw = ImageDraw.Draw(image)
    y = 10
    while y < height - 30:
        size = int(rng.integers(14, 32))
        line = " ".join(rng.choice(WORDS, int(rng.integers(2, 7))))
        ink = tuple(int(v) for v in rng.integers(0, 90, 3))
        draw.text((int(rng.integers(5, 60)), y), line, fill=ink, font=_font(size))
        y += size + int(rng.integers(6, 30))
    return _normalised(image)


def text_line(seed: int, height: int = 48, width: int = 320, flipped: bool = False) -> np.ndarray:
    """One line of text (PP-OCR recognizer/classifier input, 1x3xHxW), upside down
    when ``flipped`` (what the direction classifier tells apart)."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    image = Image.new("RGB", (width, height), tuple(int(v) for v in rng.integers(210, 256, 3)))
    text = " ".join(rng.choice(WORDS, int(rng.integers(1, 4))))
    ink = tuple(int(v) for v in rng.integers(0, 80, 3))
    ImageDraw.Draw(image).text((4, 6), text, fill=ink, font=_font(int(rng.integers(26, 34))))
    if flipped:
        image = image.rotate(180)
    return _normalised(image)


def speech(seed: int, samples: int = 512, rate: int = 16000) -> np.ndarray:
    """Speech-like audio (1 x samples, float32 in [-1, 1]): voiced harmonics under a
    syllable-rate envelope, with noise."""
    rng = np.random.default_rng(seed)
    t = (np.arange(samples) + int(rng.integers(0, rate))) / rate
    pitch = float(rng.uniform(90, 220))
    voiced = sum(np.sin(2 * np.pi * pitch * k * t) / k for k in range(1, 6))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * float(rng.uniform(3, 6)) * t)
    audio = 0.3 * voiced * envelope + 0.02 * rng.standard_normal(samples)
    return np.clip(audio, -1, 1).astype(np.float32)[None]
