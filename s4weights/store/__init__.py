"""Stores: ``open_store(url_or_dir)`` gives the store for a plain path, ``file://`` or (with the
``s3`` extra) ``s3://bucket/prefix``."""

from __future__ import annotations

import os
from urllib.parse import unquote, urlparse

from s4weights.store.base import ObjectWriter, Store
from s4weights.store.local import LocalStore


def open_store(url_or_dir: str | os.PathLike[str] | Store) -> Store:
    if isinstance(url_or_dir, Store):
        return url_or_dir
    text = os.fspath(url_or_dir)
    parsed = urlparse(text)
    if parsed.scheme == "file":
        return LocalStore(unquote(parsed.path))
    if parsed.scheme == "s3":
        from s4weights.store.s3 import S3Store
        return S3Store.from_url(text)
    if parsed.scheme and len(parsed.scheme) > 1:
        raise ValueError(f"unsupported store URL scheme {parsed.scheme!r} in {text!r}")
    return LocalStore(text)


__all__ = ["LocalStore", "ObjectWriter", "Store", "open_store"]
