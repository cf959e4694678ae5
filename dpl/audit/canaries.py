"""The audit's training data: canary gradients (white box), ordinary examples, and a linear model whose per-example
gradient is exactly the chosen direction."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

if TYPE_CHECKING:  # pragma: no cover
    from dpl.audit.config import AuditConfig


class CanaryData:
    """Canary directions, the inclusion vector and the training set (rows of inputs x and output weights y;
    example j's gradient is y_j x_j^T, norm |y_j| |x_j|)."""

    def __init__(self, cfg: AuditConfig, gen: torch.Generator) -> None:
        rows, cols = cfg.shape()
        m, C = cfg.canaries, cfg.max_grad_norm
        self.rows, self.cols, self.m = rows, cols, m
        if cfg.canary_type == "dirac":
            cells = torch.randperm(rows * cols, generator=gen)[:m]
            self.cell_rows, self.cell_cols = cells // cols, cells % cols
            cy = torch.zeros(m, rows).index_put_((torch.arange(m), self.cell_rows), torch.tensor(1.0))
            cx = torch.zeros(m, cols).index_put_((torch.arange(m), self.cell_cols), torch.tensor(1.0))
        else:
            self.cell_rows = self.cell_cols = None
            cy = _unit_rows(torch.randn(m, rows, generator=gen))
            cx = _unit_rows(torch.randn(m, cols, generator=gen))
        self.cy, self.cx = cy, cx  # unit vectors: u_i = cy_i cx_i^T
        self.included = torch.rand(m, generator=gen) < 0.5
        n = cfg.examples
        ey = _unit_rows(torch.randn(n, rows, generator=gen))
        ex = _unit_rows(torch.randn(n, cols, generator=gen)) * (cfg.example_norm * C)
        inc = self.included.nonzero().flatten()
        k = cfg.rows_per_user
        # unit "user": every canary a user of k copies of itself (its rows' gradients align: the worst case), every
        # ordinary example a user of k independent random rows
        x = [cx[inc].repeat_interleave(k, 0) * (cfg.canary_norm * C), ex]
        y = [cy[inc].repeat_interleave(k, 0), ey]
        if k > 1:
            x.append(_unit_rows(torch.randn(n * (k - 1), cols, generator=gen)) * (cfg.example_norm * C))
            y.append(_unit_rows(torch.randn(n * (k - 1), rows, generator=gen)))
        self.x, self.y = torch.cat(x), torch.cat(y)
        canary_users = [f"c{int(i)}" for i in inc for _ in range(k)]
        self.user_keys = canary_users + [f"e{j}" for j in range(n)] + [f"e{j}" for j in range(n) for _ in range(k - 1)]

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def batch(self, indices: Sequence[int]) -> dict[str, Tensor]:
        idx = torch.as_tensor(list(indices), dtype=torch.long)
        return {"x": self.x[idx], "y": self.y[idx]}

    def project(self, matrix: Tensor) -> Tensor:
        """<matrix, u_i> for every canary (float64)."""
        matrix = matrix.detach().double()
        if self.cell_rows is not None:
            return matrix[self.cell_rows, self.cell_cols]
        return ((self.cy.double() @ matrix) * self.cx.double()).sum(dim=1)


def _unit_rows(t: Tensor) -> Tensor:
    return t / t.norm(dim=1, keepdim=True).clamp(min=1e-12)


class LinearCanaryModel(nn.Module):
    """``loss_j = y_j . (W x_j)``: its gradient in W is ``y_j x_j^T`` whatever W is. ``layers`` > 1 splits W's rows
    into that many linear layers (each a group of ``privacy.clipping: per_layer``); :meth:`weight` is W."""

    def __init__(self, rows: int, cols: int, layers: int = 1) -> None:
        super().__init__()
        sizes = [len(part) for part in torch.arange(rows).tensor_split(layers)]
        self.parts = nn.ModuleList(nn.Linear(cols, size, bias=False) for size in sizes)
        for part in self.parts:
            nn.init.zeros_(part.weight)

    def weight(self) -> Tensor:
        """W (rows x cols): the layers' weights, stacked."""
        return torch.cat([part.weight for part in self.parts])

    def per_example_loss(self, batch: dict[str, Tensor]) -> Tensor:
        return (torch.cat([part(batch["x"]) for part in self.parts], dim=-1) * batch["y"]).sum(dim=-1)
