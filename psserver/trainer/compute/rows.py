"""A trainer's view of one batch's embedding rows: the unique ids it asks each server for, and
the rows and row gradients that come back and go up.

The batch's ids are de-duplicated per table (``torch.unique``); each unique id goes to the
server that owns it (``tables.owner``), so a step sends each server one request with its ids
of every table. The rows come back as one leaf tensor per table, which the model reads through
the batch's inverse index: autograd sums the gradients of an id that several samples hold into
its one row, and those ``[unique ids, dim]`` gradients are what goes up, never a dense table.
"""

from __future__ import annotations

import torch

from psserver.common.partition import owner


class RowBatch:
    """The ids of one batch (``[B, columns]`` int64), split by table and by server."""

    def __init__(self, ids: torch.Tensor, tables: list[tuple[str, int]], num_servers: int) -> None:
        """``tables``: (name, column of ``ids``) of each table, in the model's order."""
        ids = ids.to("cpu", torch.int64)
        self.names = [name for name, _ in tables]
        self.num_servers = num_servers
        self.inverse: list[torch.Tensor] = []
        self.unique: list[torch.Tensor] = []
        self._where: list[list[torch.Tensor]] = []  # table -> server -> positions among its unique ids
        self.requests: list[dict[str, torch.Tensor]] = [{} for _ in range(num_servers)]
        """What to ask each server for: ``{table: its unique ids}``."""
        for name, column in tables:
            unique, inverse = torch.unique(ids[:, column], return_inverse=True)
            self.unique.append(unique)
            self.inverse.append(inverse)
            own = owner(unique, num_servers)
            where = []
            for s in range(num_servers):
                pos = (own == s).nonzero().squeeze(1) if num_servers > 1 else torch.arange(unique.numel())
                where.append(pos)
                self.requests[s][name] = unique[pos]
            self._where.append(where)

    @property
    def num_ids(self) -> int:
        """Unique ids over all tables (what the rows' traffic grows with)."""
        return sum(u.numel() for u in self.unique)

    def assemble(self, replies: list[dict[str, torch.Tensor]], device: torch.device,
                 requires_grad: bool) -> list[torch.Tensor]:
        """One ``[unique ids, dim]`` fp32 tensor per table from every server's rows, on ``device``
        (leaves that take the gradient when ``requires_grad``)."""
        out = []
        for t, name in enumerate(self.names):
            parts = [reply[name] for reply in replies]
            dim = parts[0].shape[1]
            rows = torch.empty(self.unique[t].numel(), dim)
            for s, part in enumerate(parts):
                rows[self._where[t][s]] = part.to(torch.float32)
            rows = rows.to(device, non_blocking=True)
            out.append(rows.requires_grad_(requires_grad))
        return out

    def per_sample(self, rows: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each sample's row of each table (``[B, dim]``), through the inverse index."""
        return [r[inv.to(r.device)] for r, inv in zip(rows, self.inverse, strict=True)]

    def split_grads(self, grads: list[torch.Tensor], dtype: torch.dtype) -> list[dict[str, torch.Tensor]]:
        """The row gradients of each table as one ``{table: [n, dim]}`` per server, in the order
        of its request, on the CPU in ``dtype``."""
        out: list[dict[str, torch.Tensor]] = [{} for _ in range(self.num_servers)]
        for t, name in enumerate(self.names):
            g = grads[t].detach()
            for s in range(self.num_servers):
                out[s][name] = g[self._where[t][s].to(g.device)].to("cpu", dtype)
        return out
