"""What several experiments share, so that no job module is imported as a library: the
composition gate (`gate`), the edit drivers and their records (`edits`), the comparison of a
composed cache's logits with a full prefill's (`compare`)."""
