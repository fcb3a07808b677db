"""Images in requests: OpenAI's ``image_url`` parts and Anthropic's ``image`` blocks.

What it is: ``data_url`` and ``base64_image`` turn an image part of either API into a
``RequestImage`` — its bytes decoded whole by Pillow here, where the request enters
(``store.images.decode``: not an image, truncated or damaged, over the decompression-bomb
limit: a 400 naming the field), with the field's name kept for the answers that come later
(an image sent to a text model). A message holds its images as content hashes
(``{"images": [digest, …]}``) before its text, as ``Session.turn`` and the chat template
render them: the order of text and image parts within one message is not kept.

Nothing is stored here: the turn stores a request's images (``store.images.ImageStore``) on
the model thread, once every image and the model have accepted them (``app.py``). Remote
images (``http(s)://`` URLs, Anthropic's ``url`` sources) are refused: the server fetches
nothing. What it is not: the image processor (the model's, ``model/vision.py``).
"""

from __future__ import annotations

import base64
import binascii

from ..errors import BadInput
from .chat import MAX_BODY, RequestImage, bad, kind_of, unknown_keys

MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")  # Anthropic's list
DETAILS = ("auto", "low", "high")  # OpenAI's ``detail`` (accepted; the processor decides)


def data_url(part: dict, where: str) -> RequestImage:
    """OpenAI's ``{"type": "image_url", "image_url": {"url": "data:image/…;base64,…",
    "detail"?}}``, decoded. Raises ApiError (400) naming the field."""
    unknown_keys(part, {"type", "image_url"}, where)
    spec = part.get("image_url")
    if not isinstance(spec, dict):
        raise bad(f"{where}.image_url must be an object with a url, not {kind_of(spec)}",
                  f"{where}.image_url")
    unknown_keys(spec, {"url", "detail"}, f"{where}.image_url")
    detail = spec.get("detail")
    if detail is not None and detail not in DETAILS:
        raise bad(f"{where}.image_url.detail must be one of {', '.join(DETAILS)}",
                  f"{where}.image_url.detail")
    url, at = spec.get("url"), f"{where}.image_url.url"
    if not isinstance(url, str):
        raise bad(f"{at} must be a string, not {kind_of(url)}", at)
    if url[:8].lower().startswith(("http://", "https://")):
        raise bad(f"{at}: remote images are not fetched; send the image itself as a data URL "
                  "(data:image/png;base64,…)", at)
    head, comma, payload = url.partition(",")
    if not head[:5].lower() == "data:" or not comma:
        raise bad(f"{at} must be a data URL (data:image/png;base64,…)", at)
    media, _, encoding = head[5:].partition(";")
    if not media.lower().startswith("image/") or encoding.lower() != "base64":
        raise bad(f"{at} must be a base64 data URL of an image (data:image/png;base64,…), "
                  f"not data:{head[5:][:40]}", at)
    return _decoded(payload, at, where)


def base64_image(block: dict, where: str) -> RequestImage:
    """Anthropic's ``{"type": "image", "source": {"type": "base64", "media_type", "data"}}``,
    decoded. Raises ApiError (400) naming the field."""
    unknown_keys(block, {"type", "source", "cache_control"}, where)
    source = block.get("source")
    if not isinstance(source, dict):
        raise bad(f"{where}.source: must be an object, not {kind_of(source)}",
                  f"{where}.source")
    if source.get("type") in ("url", "file"):
        raise bad(f"{where}.source.type: {source['type']!r} images are not fetched; send the "
                  "image itself (\"type\": \"base64\")", f"{where}.source.type")
    if source.get("type") != "base64":
        raise bad(f"{where}.source.type: must be \"base64\"", f"{where}.source.type")
    unknown_keys(source, {"type", "media_type", "data"}, f"{where}.source")
    if source.get("media_type") not in MEDIA_TYPES:
        raise bad(f"{where}.source.media_type: must be one of {', '.join(MEDIA_TYPES)}",
                  f"{where}.source.media_type")
    data = source.get("data")
    if not isinstance(data, str):
        raise bad(f"{where}.source.data: must be a base64 string, not {kind_of(data)}",
                  f"{where}.source.data")
    return _decoded(data, f"{where}.source.data", where)


def _decoded(payload: str, at: str, where: str) -> RequestImage:
    if len(payload) > MAX_BODY:  # (the body's own limit holds it already; said plainly)
        raise bad(f"{at}: the image is over {MAX_BODY // 2**20} MB", at)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise bad(f"{at}: not valid base64", at) from None
    from ..store.images import decode

    try:
        picture, info = decode(data, at)
    except BadInput as err:  # (its message starts with the field: ``at``)
        raise bad(str(err), at) from None
    return RequestImage(where, data, picture, info)
