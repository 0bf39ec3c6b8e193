"""The one image-decodability predicate of every training loader.

:func:`decode_image` holds PIL to DALI's CPU decoder's rules, so the torch and DALI
loaders train on and skip the same damaged images.
"""

from __future__ import annotations

import io

from PIL import Image

JPEG_SOI = b"\xff\xd8"
# PIL's text for a libjpeg error during decoding (codec status -2); truncation and
# unreadable headers have other texts and stay errors.
PIL_BROKEN_STREAM = "broken data stream"


def _is_sof(marker: int) -> bool:
    return 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC)


def jpeg_header_problem(data: bytes) -> str | None:
    """Why nvImageCodec's JPEG parser would refuse ``data``'s header, or None.

    Its rules (ITU T.81 B.1.1.2): from SOI to the first SOS, every segment starts with
    0xFF plus a non-zero marker byte (0xFF fill bytes allowed), a length field follows
    each non-SOS marker, a frame header (SOF) precedes SOS and names at most 4 components.
    """
    if data[:2] != JPEG_SOI:
        return "no JPEG start-of-image marker"
    i, n, seen_sof = 2, len(data), False
    while True:
        start = i
        if i + 2 > n:
            return f"header runs past the end of the data at byte {start}"
        first, i = data[i], i + 1
        while data[i] == 0xFF:  # fill bytes
            i += 1
            if i >= n:
                return f"header runs past the end of the data at byte {start}"
        code, i = data[i], i + 1
        if first != 0xFF or code == 0:
            return f"invalid marker 0x{first:02x}{code:02x} at byte {start}"
        if code == 0xDA:
            return None if seen_sof else "no frame header (SOF) before the scan"
        if i + 2 > n:
            return f"header runs past the end of the data at byte {start}"
        size = int.from_bytes(data[i:i + 2], "big")
        if i + size > n:
            return f"segment 0x{code:02x} at byte {start} runs past the end of the data"
        if _is_sof(code):
            if i + 8 > n:
                return f"frame header runs past the end of the data at byte {start}"
            if data[i + 7] > 4:
                return f"frame header names {data[i + 7]} components (at most 4)"
            seen_sof = True
        i += size


def _open(data: bytes, min_side: int) -> Image.Image:
    im = Image.open(io.BytesIO(data))
    if im.format == "JPEG":
        im.draft("RGB", (min_side, min_side))
    return im


def _fully_decoded_despite_error(data: bytes, min_side: int) -> Image.Image | None:
    """Decode ``data`` (whose decoding PIL ended with a libjpeg error) twice, into
    images filled with 0 and with 255 beforehand; if both come out the same, the decoder
    wrote every pixel and the error came after the last row: return the image. PIL gives
    no other sign of how far the decoder got."""
    out = []
    for fill in (0, 255):
        im = _open(data, min_side)
        im.im = Image.new(im.mode, im.size, (fill,) * len(im.getbands())).im
        try:
            im.load()
        except OSError as e:
            if not str(e).startswith(PIL_BROKEN_STREAM):
                return None
        out.append(im)
    return out[0] if out[0].tobytes() == out[1].tobytes() else None


def decode_image(data: bytes, min_side: int) -> Image.Image:
    """Decode image bytes to an RGB PIL image, refusing (OSError or PIL's own errors)
    exactly what DALI's CPU decoder refuses: nvImageCodec's header check refuses a broken
    marker sequence, and a libjpeg error after the last pixel row keeps the decoded image.
    So with ``skip_corrupt`` the torch and DALI loaders skip the same damaged JPEGs
    (``tests/test_data_decoder_agreement.py``). Truncated JPEGs are refused before
    decoding by :func:`~.recordio.check_rec`; non-JPEG images are decoded by PIL. JPEGs
    use PIL's draft mode at no less than ``min_side`` on the short side."""
    if data[:2] == JPEG_SOI:
        problem = jpeg_header_problem(data)
        if problem:
            raise OSError(f"broken JPEG header: {problem}")
    im = _open(data, min_side)
    try:
        im.load()
    except OSError as e:
        if im.format != "JPEG" or not str(e).startswith(PIL_BROKEN_STREAM):
            raise
        full = _fully_decoded_despite_error(data, min_side)
        if full is None:
            raise
        im = full
    return im.convert("RGB")


def undecodable(exc: BaseException) -> str:
    """The reason given for an image :func:`decode_image` refuses (every loader words
    it so)."""
    return f"undecodable image ({type(exc).__name__}: {exc})"
