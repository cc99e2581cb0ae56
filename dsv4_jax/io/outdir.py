"""Output directories written atomically, with one rule for every command (dsv4-convert, dsv4-sweep,
dsv4-batch-eval).

- The target may be missing or an existing *empty* directory (there is nothing in it to lose); a
  non-empty directory is refused unless `overwrite`, a file always.
- Missing parent directories are created, like `mkdir -p`.
- Everything is written into a temporary sibling `<name>.incomplete-<pid>` that replaces the target
  only when complete. On failure (or Ctrl-C) the temporary directory is removed, and so are the
  parent directories this run created: a failed run leaves the file system as it found it.
- Directories are created with the default mode (0o777 less the umask, 0755 for the usual umask
  022) and files by plain `open`, so the output has normal permissions (no 0700 `mkdtemp`).
  The temporary name is not hidden: Orbax's partial finalize fails silently on dot-prefixed paths.
"""
from __future__ import annotations

import os
import shutil


class OutDirError(ValueError):
    """An output directory that may not be written (not empty, a file, or not creatable)."""


def _first_existing(path: str) -> str:
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def check_apart(path: str | os.PathLike, sources, label: str = "output directory") -> None:
    """Raise when `path` is one of `sources`, lies inside one, or contains one (symlinks resolved): writing
    or replacing it would destroy the input. Holds with --overwrite too."""
    out = os.path.realpath(os.fspath(path))
    for src in sources:
        if src is None:
            continue
        s = os.path.realpath(os.fspath(src))
        rel = ("is" if out == s else "lies inside" if out.startswith(s.rstrip(os.sep) + os.sep)
               else "contains" if s.startswith(out.rstrip(os.sep) + os.sep) else None)
        if rel:
            raise OutDirError(f"{label} {os.fspath(path)!r} {rel} the source {os.fspath(src)!r}; choose an output "
                              "directory apart from the sources (refused even with --overwrite)")


def check_target(path: str | os.PathLike, overwrite: bool = False, label: str = "output directory") -> None:
    """Raise unless `path` may be written: missing or empty (or non-empty with overwrite), and its
    nearest existing ancestor a writable directory. Checked before any work starts."""
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path) and not os.path.isdir(path):
        raise OutDirError(f"{label} {path!r} exists and is not a directory")
    if os.path.isdir(path) and os.listdir(path) and not overwrite:
        raise OutDirError(f"{label} {path!r} exists and is not empty (pass --overwrite to replace it)")
    base = _first_existing(os.path.dirname(path))
    if not os.path.isdir(base):
        raise OutDirError(f"{label} {path!r}: cannot create it, {base!r} is a file")
    if not os.access(base, os.W_OK | os.X_OK):
        raise OutDirError(f"{label} {path!r}: cannot create it, {base!r} is not writable")


def make_parents(path: str) -> list[str]:
    """Create the missing parent directories of `path`; returns them, deepest first."""
    made, parent = [], os.path.dirname(path)
    while not os.path.exists(parent):
        made.append(parent)
        parent = os.path.dirname(parent)
    for d in reversed(made):
        os.mkdir(d)
    return made


class AtomicDir:
    """Context manager: `tmp`, a temporary sibling of `final`, renamed to `final` by `commit()`;
    without a commit it is removed on exit, with the parents it created.

    create=False leaves creating `tmp` to the writer (Orbax creates its item directory itself).
    """

    def __init__(self, final: str | os.PathLike, overwrite: bool = False, create: bool = True,
                 label: str = "output directory"):
        self.final = os.path.abspath(os.fspath(final))
        check_target(self.final, overwrite, label)
        parent, name = os.path.split(self.final)
        self.tmp = os.path.join(parent, f"{name}.incomplete-{os.getpid()}")
        self.create = create
        self.committed = False
        self._made: list[str] = []

    def __enter__(self) -> "AtomicDir":
        self._made = make_parents(self.final)
        shutil.rmtree(self.tmp, ignore_errors=True)
        if self.create:
            os.mkdir(self.tmp)
        return self

    def commit(self) -> None:
        """Put `tmp` in place of `final` (an existing `final` is moved aside first, then deleted)."""
        old = None
        if os.path.lexists(self.final):
            old = f"{self.tmp}.old"
            os.rename(self.final, old)
        os.rename(self.tmp, self.final)
        self.committed = True
        if old:
            shutil.rmtree(old, ignore_errors=True)

    def __exit__(self, *exc) -> bool:
        if not self.committed:
            shutil.rmtree(self.tmp, ignore_errors=True)
            parent, base = os.path.split(self.tmp)
            for name in os.listdir(parent) if os.path.isdir(parent) else ():
                if name.startswith(base + "."):         # writers' own siblings, e.g. Orbax's `.partial_save`
                    shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
            for d in self._made:              # deepest first; only if still empty
                try:
                    os.rmdir(d)
                except OSError:
                    break
        return False
