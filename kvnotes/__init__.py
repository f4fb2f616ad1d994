"""kvnotes: read, edit and compose the KV cache of language models."""

from kvnotes.edit.editable import EditableCache, EditError, EditResult

__all__ = ["EditError", "EditResult", "EditableCache"]
