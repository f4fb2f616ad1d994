"""Which rope variants a delta rotation of cached keys gets right, and the refusal of the rest.

R(p + d) = R(d) R(p) holds only while the inverse frequencies do not depend on the sequence:
rope types outside `STATIC_ROPE_TYPES` and partial rotary are refused with the reason. It lives
with the models (the family adapters read it when they build cos/sin); `kvnotes.engine.rope`
rotates with it.
"""

from __future__ import annotations

from kvnotes.errors import KvnotesError

STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # inv_freq fixed once: R(p+d) = R(d)R(p)
_WHY = {
    "dynamic": "dynamic NTK recomputes its frequencies from the sequence length",
    "longrope": "longrope switches from its short to its long factors once a sequence passes "
                "original_max_position_embeddings, so a key rotated by delta from a short block "
                "does not match the key computed in the long context",
}


class UnsupportedRopeError(KvnotesError, NotImplementedError):
    """A rope variant whose cached keys cannot be moved exactly by one rotation."""


def check_rope_type(rope_type: str, layer: int | None = None, partial_rotary_factor: float = 1.0) -> None:
    """Refuse, with the reason, every rope variant a delta rotation would get silently wrong."""
    where = "" if layer is None else f" (layer {layer})"
    if rope_type not in STATIC_ROPE_TYPES:
        why = _WHY.get(rope_type, "kvnotes has not verified that its frequencies are static")
        raise UnsupportedRopeError(
            f"rope_type {rope_type!r}{where} is not supported for re-rotating cached keys: {why}. "
            f"Supported: {', '.join(STATIC_ROPE_TYPES)}; `python -m kvnotes.compose.verify MODEL` checks a model."
        )
    if partial_rotary_factor != 1.0:
        raise UnsupportedRopeError(
            f"partial rotary (factor {partial_rotary_factor}){where} is not supported for "
            "re-rotating cached keys"
        )
