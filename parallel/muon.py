"""Per-Head Muon under ZeRO-1: whole matrices orthogonalised on one owner rank each (the Kimi K3
report's §2.5 and §5.2.2).

ZeRO-1 gives each data-parallel rank a flat slice of a bucket's gradient (parallel/optimizer.py), but Newton-
Schulz needs whole matrices. Every matrix of a Muon bucket (one head's block of a Q / K / V projection, one
expert's weight, a whole projection) gets one owner rank in the bucket's group, balanced by its Newton-Schulz
cost (longest first, to the least loaded rank; the loads carry over the group's buckets). Per step and bucket:
each rank updates the momentum of its slice; one all-to-all sends every piece of its slice's (Nesterov)
direction to the owner of the matrix the piece belongs to; each owner orthogonalises its whole matrices,
batched by shape; a second all-to-all returns each piece of the update to the rank whose slice holds it, which
applies it to its master slice. ZeRO-1's all-gather then spreads the parameters, as for AdamW. A rank sends and
receives about its slice twice: the bytes of one more reduce-scatter and all-gather.

Tensor parallelism: a per-head rule needs nothing more (a tensor-parallel rank holds whole heads). A whole-
matrix rule on a tensor-parallel slice (o_proj's columns, an MLP's rows) needs the other slices: the owners of
that matrix on the tensor-parallel ranks (the same rank of their data-parallel groups, which assign the same
owners) all-gather their slices, each orthogonalises the whole matrix and keeps its own slice: tp times the
work of that matrix and no further exchange (the "duplicated" mode of emerging-optimizers' tensor-parallel
Muon, which megatron-core wraps).

The exchange is fixed when the optimizer is built (pieces, splits, owners): a step reads nothing on the host.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_pretrain.ops.newton_schulz import muon_update
from parallel.collectives import all_gather_into_async, all_to_all_flat, group_size

BATCH_ELEMENTS = 2**24
"""Matrices of one shape are orthogonalised in batches of at most this many elements (one matrix if larger), so
the step's working memory beyond the received and returned pieces stays a few batches (planning/
stage_memory.py's MUON_STEP_BYTES), not copies of every matrix a rank owns."""


@dataclass(frozen=True)
class MatrixSpec:
    """How Muon sees one parameter as this rank holds it."""

    shape: tuple[int, int, int]
    """[matrices, rows, columns]: the parameter as a batch of matrices (stacked experts; one for a projection)."""
    block_rows: int = 0
    """Rows per orthogonalised block (one head's); 0: each matrix whole."""
    tensor_dim: int | None = None
    """-2 (rows) or -1 (columns): the dimension this matrix is split along over the tensor-parallel group, when
    Muon must see it whole (a whole-matrix rule on a tensor-parallel slice); None: whole on this rank."""

    @property
    def matrix_numel(self) -> int:
        return self.shape[1] * self.shape[2]


@dataclass(frozen=True)
class _Matrix:
    """One orthogonalised matrix: where it lies in its bucket's flat buffer, its shape here."""

    start: int
    rows: int
    columns: int
    tensor_dim: int | None

    @property
    def end(self) -> int:
        return self.start + self.rows * self.columns

    def whole_shape(self, tp: int) -> tuple[int, int]:
        """Its shape once the tensor-parallel slices are joined."""
        rows, columns = self.rows, self.columns
        if self.tensor_dim == -2:
            rows *= tp
        elif self.tensor_dim == -1:
            columns *= tp
        return rows, columns


def newton_schulz_cost(rows: int, columns: int) -> int:
    """Multiply-adds of one Newton-Schulz step on a [rows, columns] matrix, up to a constant: the Gram matrix and
    its products cost small^2 x large each (small, large = the shorter, the longer side)."""
    small, large = sorted((rows, columns))
    return small * small * large


def bucket_matrices(specs: list[MatrixSpec], offsets: list[int]) -> list["_Matrix"]:
    """The orthogonalised matrices of a bucket's parameters (at these flat offsets), in flat order."""
    matrices = []
    for spec, offset in zip(specs, offsets):
        count, rows, columns = spec.shape
        block = spec.block_rows or rows
        if rows % block or (spec.block_rows and spec.tensor_dim is not None):
            raise ValueError(f"MatrixSpec {spec}: rows must split into blocks, and a per-head rule needs no "
                             f"tensor-parallel join")
        for i in range(count * rows // block):
            matrices.append(_Matrix(offset + i * block * columns, block, columns, spec.tensor_dim))
    return matrices


def assign_owners(matrices: list[_Matrix], loads: list[int], tp: int) -> list[int]:
    """An owner rank per matrix: longest Newton-Schulz first, each to the least loaded rank (lowest on ties);
    `loads` (one per rank of the group) is updated, so the next bucket of the group continues the balance."""
    costs = [newton_schulz_cost(*m.whole_shape(tp)) for m in matrices]
    owners = [0] * len(matrices)
    for i in sorted(range(len(matrices)), key=lambda i: (-costs[i], i)):
        owner = min(range(len(loads)), key=lambda r: (loads[r], r))
        owners[i] = owner
        loads[owner] += costs[i]
    return owners


class MuonExchange:
    """One Muon bucket's fixed exchange: which pieces of this rank's slice go to which owner, and where the
    pieces of the matrices it owns arrive."""

    def __init__(self, specs: list[MatrixSpec], offsets: list[int], numel: int, shard_numel: int,
                 group: dist.ProcessGroup | None, loads: list[int], tp_group: dist.ProcessGroup | None):
        self.group, self.tp_group = group, tp_group
        size, rank = group_size(group), 0 if group is None else dist.get_rank(group)
        self.rank = rank
        self.tp, self.tp_rank = group_size(tp_group), 0 if tp_group is None else dist.get_rank(tp_group)
        matrices = bucket_matrices(specs, offsets)
        owners = assign_owners(matrices, loads, self.tp)
        lo, hi = rank * shard_numel, min((rank + 1) * shard_numel, numel)
        # What this rank sends: its slice's pieces, grouped by owner (flat order within), as slice-local ranges.
        # Only the matrices overlapping the slice are visited, and each matrix only with the ranks its elements
        # lie on: set-up is linear in the bucket's matrices, not in matrices x ranks.
        self.send_pieces: list[tuple[int, int]] = []
        self.send_splits = [0] * size
        overlapping = [(o, m) for m, o in zip(matrices, owners) if m.start < hi and m.end > lo]
        for owner, m in sorted(overlapping, key=lambda pair: pair[0]):  # stable: flat order within an owner
            a, b = max(m.start, lo), min(m.end, hi)
            self.send_pieces.append((a - lo, b - lo))
            self.send_splits[owner] += b - a
        # What it receives: from each rank q in order, the pieces of its own matrices within q's slice.
        self.mine = [m for m, o in zip(matrices, owners) if o == rank]
        arriving = sorted(((q, m) for m in self.mine for q in range(m.start // shard_numel,
                                                                      (m.end - 1) // shard_numel + 1)),
                          key=lambda pair: pair[0])
        self.pieces: dict[int, list[tuple[int, int]]] = {m.start: [] for m in self.mine}
        """Matrix start -> its pieces (offset in the received buffer, length), in flat order."""
        self.recv_splits = [0] * size
        at = 0
        for q, m in arriving:
            a, b = max(m.start, q * shard_numel), min(m.end, (q + 1) * shard_numel)
            self.pieces[m.start].append((at, b - a))
            at += b - a
            self.recv_splits[q] += b - a
        self.shapes: dict[tuple[int, int, int | None], list[_Matrix]] = {}
        for m in self.mine:
            self.shapes.setdefault((m.rows, m.columns, m.tensor_dim), []).append(m)
        self.joined = [m for m in self.mine if m.tensor_dim is not None and self.tp > 1]
        """The owned matrices whose tensor-parallel slices are joined for the iteration."""

    @property
    def sent_elements(self) -> int:
        """Elements this rank sends to other ranks per step: its pieces owned elsewhere, out and back."""
        return 2 * (sum(self.send_splits) - self.send_splits[self.rank])

    def update(self, direction: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the bucket's Muon update, from its slice of the direction (both [shard_numel])."""
        # At most two slice-sized buffers besides the direction live at once (planning/stage_memory.py).
        send = torch.cat([direction[a:b] for a, b in self.send_pieces]) if self.send_pieces else direction[:0]
        received = all_to_all_flat(send, self.recv_splits, self.send_splits, self.group)
        del send
        back = torch.empty_like(received)
        joined = self._joined_slices(received)
        for (rows, columns, tensor_dim), matrices in self.shapes.items():
            per_batch = max(1, BATCH_ELEMENTS // (rows * columns * (self.tp if tensor_dim is not None else 1)))
            for first in range(0, len(matrices), per_batch):
                batch = matrices[first:first + per_batch]
                if tensor_dim is not None and self.tp > 1:
                    whole = torch.stack([joined[m.start] for m in batch])
                    updates = muon_update(whole).chunk(self.tp, whole.dim() + tensor_dim)[self.tp_rank]
                else:
                    updates = muon_update(torch.stack([self._gather(m, received).view(rows, columns) for m in batch]))
                for m, u in zip(batch, updates):
                    self._scatter(m, u, back)
        del received, joined
        returned = all_to_all_flat(back, self.send_splits, self.recv_splits, self.group)
        del back
        result = torch.zeros_like(direction)
        at = 0
        for a, b in self.send_pieces:
            result[a:b] = returned[at:at + b - a]
            at += b - a
        return result

    def _gather(self, m: _Matrix, received: torch.Tensor) -> torch.Tensor:
        pieces = [received[at:at + n] for at, n in self.pieces[m.start]]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def _scatter(self, m: _Matrix, update: torch.Tensor, back: torch.Tensor) -> None:
        flat, done = update.reshape(-1), 0
        for at, n in self.pieces[m.start]:
            back[at:at + n] = flat[done:done + n]
            done += n

    def _joined_slices(self, received: torch.Tensor) -> dict[int, torch.Tensor]:
        """Matrix start -> the whole matrix, joined from every tensor-parallel rank's slice (one all-gather of
        all of them; the tensor-parallel owners of a matrix hold the same list)."""
        if not self.joined:
            return {}
        local = torch.cat([self._gather(m, received) for m in self.joined])
        everyone = local.new_empty(self.tp * local.numel())
        work = all_gather_into_async(everyone, local, self.tp_group)
        if work is not None:
            work.wait()
        everyone = everyone.view(self.tp, -1)
        joined, at = {}, 0
        for m in self.joined:
            n = m.rows * m.columns
            slices = [everyone[r, at:at + n].view(m.rows, m.columns) for r in range(self.tp)]
            joined[m.start] = torch.cat(slices, dim=m.tensor_dim)
            at += n
        return joined
