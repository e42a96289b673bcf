"""Folders written whole: what an export, a staging for the Hub or any other folder of several files is written
through, so that a kill, a full disk or an error part-way leaves the previous folder as it was, never half of a new
one beside half of the old.

The files go to a temporary folder beside the destination, which is renamed into place once complete (the previous
folder moved aside first and removed after; a kill between those two renames is undone by the next write). The
pattern is the one training keeps `best/` by.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path


def _siblings(dest: Path) -> tuple[Path, Path]:
    """The temporary folder a new `dest` is written in, and where the previous one waits while they swap: hidden,
    beside it (a rename within one folder), named so that no folder of the user's is taken for one."""
    return dest.with_name(f".{dest.name}.selfspec-partial"), dest.with_name(f".{dest.name}.selfspec-old")


def check_writable(folder, what: str) -> None:
    """Raise a ValueError naming the path and the fix where `folder` could not be written as a whole: a file at its
    place or above it, or a folder (itself, or where it would be made) that cannot be written."""
    path = Path(os.path.realpath(folder))  # a link to a folder: the folder it points to is the one written
    if path.exists() and not path.is_dir():
        raise ValueError(f"{what} {folder} is a file; choose an empty or new folder")
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{what} {folder} cannot be made: {parent} is a file, not a folder; choose another folder")
    for place in ([path] if path.exists() else []) + [parent]:
        if not os.access(place, os.W_OK | os.X_OK):
            raise ValueError(f"{what} {folder} cannot be written: {place} is read-only for this user (the folder is "
                             f"written beside itself, in {parent}, then renamed into place); make it writable or "
                             "choose another folder")


@contextlib.contextmanager
def written_whole(dest) -> Iterator[Path]:
    """A new, empty temporary folder beside `dest` to write into; when the block ends without an error it becomes
    `dest`, replacing a previous `dest` whole. On an error (or an interrupt) it is removed and `dest` is left as it
    was. A process killed outright leaves the temporary folder, which the next write to `dest` removes. A `dest` that
    is a link to a folder keeps the link: the folder it points to is the one replaced."""
    dest = Path(os.path.realpath(dest))
    partial, old = _siblings(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    if old.exists():  # an earlier write was killed between its two renames below
        if dest.exists():
            shutil.rmtree(old)
        else:
            os.replace(old, dest)
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir()
    try:
        yield partial
        if dest.exists():
            os.replace(dest, old)
        os.replace(partial, dest)
    except BaseException:
        if old.exists() and not dest.exists():
            os.replace(old, dest)
        shutil.rmtree(partial, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)


def file_record(path) -> dict:
    """A file's size and sha256, as a folder written whole records its files so that a reader can tell them from
    files of another write."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return {"bytes": os.path.getsize(path), "sha256": digest.hexdigest()}
