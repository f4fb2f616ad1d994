"""The engine: the one owner of a model's forward pass and of the attention switch.

Owns prefill, extend, batched variant reads, recompute, generation, hooked runs, the KV cache
value type and RoPE rotation. Imports `kvnotes.models`, `kvnotes.measure` and `kvnotes.errors`
only; no other module of kvnotes calls a model's forward (tests/cross/test_architecture.py).
"""
