"""Composition: precompiled blocks prefilled alone, stored, RoPE-repositioned and spliced with
seam repair (`splice`), the block store (`store`), cache-reuse methods (`blend`) and the
composition go/no-go (`verify`, `python -m kvnotes.compose.verify MODEL`).

Imports the engine, tasks, models and measure; editing and the harness sit above it.
"""
