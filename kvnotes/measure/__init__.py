"""Measurement: metrics and intervals, margins, timing and memory, provenance (pure helpers).

Imports nothing of kvnotes but `kvnotes.errors`: every other room may use it.
"""
