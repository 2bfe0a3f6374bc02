"""The store interface: where checkpoint bytes live (local directories, S3).

A store holds named objects (``/``-separated names under its root). The call sequence of a save
is: ``writer(name)`` -> write the file sequentially -> ``commit()`` (the object appears whole,
atomically) or ``abort()`` (nothing appears); then ``put_atomic(manifest_name, bytes)`` marks the
checkpoint as existing. Readers only trust objects whose manifest exists, so a save killed at
any point leaves no half checkpoint visible and never touches earlier ones.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, BinaryIO

if TYPE_CHECKING:  # (the CLIs list stores without importing numpy)
    from s4format.source import ByteSource


def reading_whole(src: ByteSource) -> ByteSource:
    """``src``, told that its caller reads all of it (a load, a chain's levels): where each
    read is a round trip (S3), a small object is then fetched whole at its first read."""
    whole = getattr(src, "read_whole", None)
    if whole is not None:
        whole()
    return src


class ObjectWriter(ABC):
    """A sequential writer for one object; invisible to readers until :meth:`commit`."""

    @abstractmethod
    def write(self, data: bytes | memoryview) -> int: ...

    @abstractmethod
    def commit(self) -> None: ...

    @abstractmethod
    def abort(self) -> None: ...

    def __enter__(self) -> ObjectWriter:
        return self

    def __exit__(self, exc_type, *rest: object) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


class Store(ABC):
    url: str
    # Each read is a round trip (S3): independent objects are then better read concurrently.
    remote: bool = False

    @abstractmethod
    def writer(self, name: str) -> ObjectWriter:
        """Start writing object ``name``; replaces an existing object only on commit."""

    @abstractmethod
    def put_atomic(self, name: str, data: bytes, *, if_absent: bool = False) -> None:
        """Write a small object in one step. With ``if_absent``, fail with StorageError if it
        already exists (the conditional put that commits a manifest)."""

    @abstractmethod
    def get(self, name: str) -> bytes:
        """The whole object (small objects: manifests); StorageError if missing."""

    @abstractmethod
    def source(self, name: str) -> ByteSource:
        """Random access to a (large) object for :class:`s4format.Reader`."""

    @abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Names of committed objects under ``prefix``, sorted."""

    def list_versions(self, prefix: str = "") -> dict[str, str]:
        """Committed objects under ``prefix``, each with a version string that changes
        whenever the object is written again ("" where the store cannot tell: nothing read
        by it may then be kept)."""
        return {n: "" for n in self.list(prefix)}

    def modified(self, prefix: str = "") -> dict[str, float]:
        """Committed objects under ``prefix``, each with when it was last written (seconds
        since the epoch); for sweeping what is left over, so stores that cannot tell refuse."""
        raise NotImplementedError(f"{type(self).__name__} cannot tell when objects were written")

    @abstractmethod
    def delete(self, name: str) -> None:
        """Remove an object; missing objects are not an error."""

    def exists(self, name: str) -> bool:
        return name in self.list(name)


def as_binary_io(w: ObjectWriter) -> BinaryIO:
    """ObjectWriter already has ``write``; this only narrows the type for the s4format Writer."""
    return w  # type: ignore[return-value]
