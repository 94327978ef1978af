"""Symmetric monkey-patching: every replacement remembers how to undo itself."""

from __future__ import annotations

_MISSING = object()


class Patches:
    def __init__(self) -> None:
        self._undo: list[tuple[object, str, object]] = []

    def replace(self, owner: object, name: str, replacement: object) -> object:
        """Set owner.name = replacement; return the original (for the wrapper to call)."""
        original = owner.__dict__.get(name, _MISSING) if isinstance(owner, type) else getattr(
            owner, name, _MISSING)
        current = getattr(owner, name)
        self._undo.append((owner, name, original))
        setattr(owner, name, replacement)
        return current

    def restore_all(self) -> None:
        while self._undo:
            owner, name, original = self._undo.pop()
            try:
                if original is _MISSING:
                    delattr(owner, name)
                else:
                    setattr(owner, name, original)
            except (AttributeError, TypeError):
                pass

    def __len__(self) -> int:
        return len(self._undo)
