"""Short forwards replayed from a CUDA graph: the kernel launches of one forward, paid once.

A 1-token extend of an 8B model launches hundreds of kernels whose CPU-side cost exceeds their
GPU time, so on a GPU every short forward (one token, an erratum of a few dozen, a question over a
cached context) is bound by launches. `GraphedExtend` captures `run.extend_into` for one shape
(`n` tokens after `filled` cached ones, held in buffers the caller owns) into a CUDA graph over
static buffers: the ids are copied into a static tensor and the graph replays the whole forward,
writing its K/V into the same buffer slots the eager call writes and its logits into a static
output. Shapes are fixed at capture: a decode loop, whose cache grows by one every step, would need
one graph per length (or attention over a fixed-size buffer with a mask), which this does not do;
the variant reads of the patching map select their patched slots with `nonzero` (a host sync),
so they are not captured either. CUDA only; elsewhere a one-line ConfigError.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from kvnotes.engine.cache import KVCache
from kvnotes.engine.run import Ids, Step, as_ids, check_positions, extend_into
from kvnotes.errors import ConfigError
from kvnotes.models.loading import LoadedModel


class GraphedExtend:
    """`extend_into(model, keys, values, filled, ids)` for ids of shape [batch, n], captured once."""

    def __init__(
        self,
        model: LoadedModel,
        keys: Sequence[Tensor],
        values: Sequence[Tensor],
        filled: int,
        n: int,
        batch: int = 1,
        logits_to_keep: int = 1,
        warmup: int = 3,
    ) -> None:
        if model.device.type != "cuda" or not torch.cuda.is_available():
            raise ConfigError(f"CUDA graphs need a CUDA device; model {model.name!r} is on {model.device}")
        room = min(int(t.shape[2]) for t in (*keys, *values))
        if n < 1 or filled < 0 or filled + n > room:
            raise ValueError(f"buffers hold {room} positions; {filled} filled + {n} new do not fit")
        check_positions(model, filled, n)
        self.model, self.keys, self.values, self.filled, self.n = model, list(keys), list(values), filled, n
        self.logits_to_keep = logits_to_keep
        self.ids = torch.zeros(batch, n, dtype=torch.long, device=model.device)  # static input
        side = torch.cuda.Stream(model.device)
        side.wait_stream(torch.cuda.current_stream(model.device))
        with torch.cuda.stream(side):  # warm-up: allocator, cuBLAS handles, lazily built kernels
            for _ in range(warmup):
                self._eager()
        torch.cuda.current_stream(model.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._eager()  # static output, rewritten by every replay

    def _eager(self) -> Tensor:
        return extend_into(self.model, self.keys, self.values, self.filled, self.ids, self.logits_to_keep).logits

    def __call__(self, ids: Ids) -> Step:
        """Replay the forward on `ids`: its K/V go into the buffers' slots filled..filled + n."""
        x = as_ids(self.model, ids)
        if x.shape != self.ids.shape:
            raise ValueError(f"this graph was captured for ids of shape {tuple(self.ids.shape)}, got {tuple(x.shape)}")
        self.ids.copy_(x)
        self.graph.replay()
        end = self.filled + self.n
        cache = KVCache(tuple(k[:, :, :end] for k in self.keys), tuple(v[:, :, :end] for v in self.values))
        return Step(self.logits.clone(), cache)
