"""A composed (or edited) cache's next-token logits against a full prefill's: cosine, top-1
agreement, KL(ref || logits) and the decision among the item's outcome tokens."""

from __future__ import annotations

from typing import Any

import torch

from kvnotes.measure.metrics import kl_divergence, logit_cosine, top1_agree


def compare(logits: torch.Tensor, ref: torch.Tensor, decision_ids: tuple[int, ...]) -> dict[str, Any]:
    """Cosine, top-1, KL(ref || logits) and the decision (outcome token id) of both ([vocab])."""
    ids = list(decision_ids)
    got, want = ids[int(logits[ids].argmax())], ids[int(ref[ids].argmax())]  # token ids
    return {
        "cosine": float(logit_cosine(logits, ref)),
        "top1_agree": bool(top1_agree(logits, ref)),
        "kl": float(kl_divergence(ref, logits)),
        "decision": got,
        "decision_ref": want,
        "decision_agree": got == want,
    }
