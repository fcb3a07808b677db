"""The images of conversations: checked once where they enter, stored once by content.

What it is: ``check`` decodes a file the user names with Pillow (the whole image, so a
truncated file fails here and not in the middle of a turn), under Pillow's decompression-bomb
limit made an error; ``ImageStore`` copies the file into the data folder
(``paths.images_dir()``, 0600) under its content hash, so a conversation resumes after the
original moved, and the same image in many conversations is one file.

The content hash covers the decoded pixels, the mode and the size (not the file's bytes: the
same picture saved twice is one image; a transposed one is another). The KV cache keys each
image token by it (``model/vision.py``), so a changed image is a cache miss from its first
token. What it is not: the image processor (resize, patches), which is the model's.

Pillow is imported by the first call, never by a text model's start.
"""

from __future__ import annotations

import hashlib
import io
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

from ..errors import BadInput, StorageError
from ..files import atomic_write

MAX_FILE_BYTES = 64 * 2**20  # larger files are refused before they are read
DIGEST = "localchat-image-1"  # what the content hash is a hash of (bump if that changes)


@dataclass(frozen=True)
class ImageInfo:
    """An image as checked: its content hash, size, mode and file format."""

    digest: str  # SHA-256 hex of DIGEST, the mode, the size and the pixels
    width: int
    height: int
    mode: str
    format: str  # Pillow's name of the file format ("PNG", "JPEG", …)
    nbytes: int  # the file's size
    name: str = ""  # the file name the user gave (shown, never used to find it)

    @property
    def chip(self) -> str:
        """One line for a person: name, W×H, size."""
        kb = self.nbytes / 1024
        size = f"{kb:.0f} KB" if kb < 1024 else f"{kb / 1024:.1f} MB"
        return f"{self.name or self.digest[:12]} {self.width}×{self.height} {size}"


def content_digest(image) -> str:
    """The content hash of a decoded Pillow image (mode, size and pixels)."""
    h = hashlib.sha256(f"{DIGEST}\0{image.mode}\0{image.width}x{image.height}\0".encode())
    h.update(image.tobytes())
    return h.hexdigest()


def decode(data: bytes, name: str):
    """``data`` decoded whole by Pillow, and its ``ImageInfo``.

    Raises:
        BadInput: not an image Pillow reads, truncated or damaged, or over Pillow's
            decompression-bomb limit (``PIL.Image.MAX_IMAGE_PIXELS``).
    """
    from PIL import Image, UnidentifiedImageError

    with warnings.catch_warnings():
        # Pillow warns between its limit and twice it, and raises past that: both refused.
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data))
            fmt = image.format or "?"
            image.load()  # the whole file: a truncated one fails now
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            raise BadInput(f"{name}: the image is too large to decode safely (over "
                           f"{Image.MAX_IMAGE_PIXELS:,} pixels)") from None
        except UnidentifiedImageError:
            raise BadInput(f"{name}: not an image (no image format Pillow reads)") from None
        except (OSError, ValueError, SyntaxError, EOFError) as err:
            # (Pillow raises these for truncated and damaged files.)
            why = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise BadInput(f"{name}: damaged or truncated image ({why})") from None
    if image.width < 1 or image.height < 1:
        raise BadInput(f"{name}: empty image")
    info = ImageInfo(content_digest(image), image.width, image.height, image.mode, fmt,
                     len(data), name)
    return image, info


def check(path: Path):
    """Read and decode the file ``path``; its bytes, the image and its ``ImageInfo``.

    Raises:
        BadInput: missing, unreadable, too big a file, or not an image (``decode``).
    """
    name = Path(path).name
    try:
        size = os.stat(path).st_size
        if size > MAX_FILE_BYTES:
            raise BadInput(f"{name}: the file is {size / 2**20:.0f} MB; images up to "
                           f"{MAX_FILE_BYTES // 2**20} MB are taken")
        data = Path(path).read_bytes()
    except IsADirectoryError:
        raise BadInput(f"{path}: a folder, not an image file") from None
    except OSError as err:
        raise BadInput(f"{path}: {err.strerror or err}") from None
    return (data, *decode(data, name))


class ImageStore:
    """Images in one folder, each file named by its content hash (``DIGEST.ext``)."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def add(self, path: Path) -> ImageInfo:
        """Check ``path`` and store a copy of it (once per content hash); its ``ImageInfo``.

        Raises:
            BadInput: see ``check``. StorageError: the data folder cannot be written.
        """
        data, _, info = check(path)
        return self.put(data, info)

    def put(self, data: bytes, info: ImageInfo) -> ImageInfo:
        """Store the checked bytes ``data`` of ``info`` unless that content is stored."""
        if self.find(info.digest) is None:
            try:
                self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
                target = self.root / f"{info.digest}.{info.format.lower()}"
                atomic_write(target, data)
                os.chmod(target, 0o600)  # (private whatever the umask: it is the user's)
            except OSError as err:
                raise StorageError(f"cannot store the image in {self.root}: "
                                   f"{err.strerror or err}") from None
        return info

    def find(self, digest: str) -> Path | None:
        """The stored file of ``digest``, or None."""
        if not (len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)):
            return None  # (never a path from a message: only hex names are looked up)
        return next(iter(sorted(self.root.glob(f"{digest}.*"))), None)

    def describe(self, digest: str) -> tuple[str, Path | None]:
        """One line for a person (``ImageInfo.chip``: hash, W×H, size) and the stored file,
        read from the file's header only; the file None when it is missing or unreadable."""
        path = self.find(digest)
        if path is None:
            return f"{digest[:12]} (missing from {self.root})", None
        info = self.header(digest, path=path)
        if info is None:
            return f"{digest[:12]} (unreadable: {path})", None
        return info.chip, path

    def header(self, digest: str, name: str = "", path: Path | None = None
               ) -> ImageInfo | None:
        """The stored image ``digest``'s size in pixels and bytes, read from its file's header
        (``mode`` and ``format`` left empty), named ``name``; None when missing or unreadable."""
        path = path or self.find(digest)
        if path is None:
            return None
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(path) as image:
                w, h = image.size
            size = path.stat().st_size
        except (OSError, UnidentifiedImageError, ValueError):
            return None
        return ImageInfo(digest, w, h, "", "", size, name)

    def discard(self, digest: str) -> None:
        """Remove the stored file of ``digest`` (one no message holds any more)."""
        path = self.find(digest)
        if path is not None:
            path.unlink(missing_ok=True)

    def open(self, digest: str):
        """The stored image ``digest``, decoded and checked against its hash.

        Raises:
            BadInput: no such image stored, or the file no longer holds that content.
        """
        path = self.find(digest)
        if path is None:
            raise BadInput(f"image {digest[:12]} is missing from {self.root}")
        _, image, info = check(path)
        if info.digest != digest:
            raise BadInput(f"image {digest[:12]} changed on disk ({path})")
        return image
