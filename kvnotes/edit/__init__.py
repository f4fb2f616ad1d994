"""Editing a cached prompt: the registry of edit strategies, `EditableCache` and patching.

Imports the engine, composition, tasks, models and measure; never the harness above it.
"""
