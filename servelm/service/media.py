"""Images in a chat request: where their bytes come from, and what the prompt holds in their place.

An image part's URL is a `data:` URL (base64), bare base64 (DJL LMI's `url`), or an http(s) URL whose host is in
the server's `--allowed-media-domains` (none by default, as vLLM's), fetched with a size limit, a timeout and no
redirects. Every failure is a 400 that names the part (`messages[1].content[0]`); an image sent to a deployment
without a vision projector is ModalityNotSupported (Azure ML's 404 on its path). The deployment's MediaReader (its
projector) turns the bytes into the prompt's pieces: marker token ids and media chunks.
"""

from __future__ import annotations

import base64
import binascii
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from servelm.engine.base import MediaReader
from servelm.engine.types import MediaChunk
from servelm.errors import InvalidParameter

Piece = tuple[int, ...] | MediaChunk  # marker tokens, or an image's positions


class ModalityNotSupported(InvalidParameter):
    def __init__(self, model: str, where: str) -> None:
        super().__init__(f"Modality not supported by the model: `{model}` reads text only (it was started without "
                         "a vision projector, --mmproj); send text parts only.", where, "modality_not_supported")


@dataclass(frozen=True)
class ImageSources:
    """Where image bytes may come from, and how much of them (the server's settings)."""

    allowed_domains: tuple[str, ...] = ()  # hosts (and their subdomains) an http(s) image may be fetched from
    max_bytes: int = 20 << 20
    timeout: float = 5.0  # seconds for a fetch: connecting, and the whole read


@dataclass(frozen=True)
class ImageInput:
    """A deployment that reads images: its projector, and the server's sources."""

    reader: MediaReader
    sources: ImageSources = ImageSources()

    def read(self, url: str, where: str) -> list[Piece]:
        data = image_bytes(url, where, self.sources)
        try:
            return self.reader.read(data)
        except ValueError as exc:
            raise InvalidParameter(f"The image at {where} cannot be read: {exc}.", where, "invalid_image") from None


def image_bytes(url: str, where: str, sources: ImageSources) -> bytes:
    """The image's bytes, from its URL (see the module doc); a 400 naming `where` for anything wrong."""
    url = url.strip()
    if url.startswith("data:"):
        header, comma, payload = url.partition(",")
        if not comma or not header.endswith(";base64"):
            raise InvalidParameter(f"The image at {where} is a data URL without base64 data "
                                   "(expected data:image/png;base64,...).", where, "invalid_image")
        data = _base64(payload, where, sources)
    elif url.startswith(("http://", "https://")):
        data = _fetch(url, where, sources)
    elif ":" not in url[:12]:  # no scheme: DJL LMI's bare base64
        data = _base64(url, where, sources)
    else:
        raise InvalidParameter(f"The image at {where} has a URL scheme this server does not read; send a data: URL or "
                               "an http(s) URL of an allowed domain.", where, "invalid_image")
    if not data:
        raise InvalidParameter(f"The image at {where} is empty.", where, "invalid_image")
    return data


def _base64(payload: str, where: str, sources: ImageSources) -> bytes:
    if len(payload) * 3 // 4 > sources.max_bytes + 3:
        raise _too_large(where, sources)
    try:
        return base64.b64decode(payload.replace("\n", "").replace("\r", ""), validate=True)
    except (binascii.Error, ValueError):
        raise InvalidParameter(f"The image at {where} is not valid base64.", where, "invalid_image") from None


def _too_large(where: str, sources: ImageSources) -> InvalidParameter:
    return InvalidParameter(f"The image at {where} is larger than this server accepts ({sources.max_bytes} bytes).",
                            where, "image_too_large")


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # a redirect could leave the allowed domains: it is an error instead


_opener = urllib.request.build_opener(_NoRedirects)


def _fetch(url: str, where: str, sources: ImageSources) -> bytes:
    host = (urllib.parse.urlsplit(url).hostname or "").lower().rstrip(".")
    if not any(host == d or host.endswith("." + d) for d in sources.allowed_domains):
        raise InvalidParameter(f"The image at {where} is on {host or 'no host'}, which this server does not fetch "
                               "from (its --allowed-media-domains); send the image as a data: URL.", where,
                               "invalid_image")
    try:
        with _opener.open(urllib.request.Request(url, headers={"User-Agent": "servelm"}),
                          timeout=sources.timeout) as resp:
            data: bytes = resp.read(sources.max_bytes + 1)
    except urllib.error.HTTPError as exc:
        raise InvalidParameter(f"The image at {where} could not be fetched: HTTP {exc.code}.", where,
                               "invalid_image") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise InvalidParameter(f"The image at {where} could not be fetched: {reason}.", where, "invalid_image") from None
    if len(data) > sources.max_bytes:
        raise _too_large(where, sources)
    return data
