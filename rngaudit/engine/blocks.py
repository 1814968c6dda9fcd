"""The replay of derive's fast path, before any column exists: `replay.Replayer` with every repeated
`make_rng` statement recorded as one template of consecutive counts, and nothing hashed while it
walks. No NumPy: a caller can count the rows first and choose a path (rngaudit.fast expands them)."""
from __future__ import annotations

from .replay import Replayer


class BlockReplayer(Replayer):
    """Replayer whose repeated make_rng statements record one template for all their calls (its `n`
    counts), expanded into columns by rngaudit.engine.table."""

    def _make_rng_item(self, inst, item, run) -> None:
        self._make_rng(inst.scope, item.stream, item.kind, item.label, item.draw, item.loc, run, n=item.repeat)

    def _expand(self) -> "BlockReplayer":
        return self

    @property
    def rows(self) -> int:
        """How many rows (call sites, per lane) the replay expands to."""
        total = 0
        sizes = self.axis_size
        for tpl in self.templates:
            lanes = 1
            for a in tpl.axes:
                lanes *= sizes[a]
            total += tpl.n * lanes
        return total
