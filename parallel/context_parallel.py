"""Context parallelism: every sequence split over the cp ranks, load-balanced for causal attention.

Shape legend: B rows, T positions of a row, F = T / (2 cp) positions of a fragment, H heads, D head dims.

A row's T positions form 2 cp fragments; rank r holds fragments r and 2 cp - 1 - r, one from the front and
one from the back (Megatron-core's layout), so every rank has the same share of causal attention and of
recurrent work. Local tensors [B, T / cp, ...] hold a rank's two fragments one after the other. Everything
position-wise (embeddings, norms, MLPs, routing, the loss) just runs on the local tokens; only the
sequence mixers talk across ranks, through their cp strategies (context_parallel_mixers.py) and the
exchanges here:
- MLA by the latent (parallel.cp_mla=latent): the per-token latent MLA's keys and values come from
  (kv_lora_rank + rope dims: 576 values at full size, against H x 320 expanded) goes to each rank whose
  queries see it: a rank receives the fragments from its documents' starts up to its own, in sequence order,
  in one all-to-all issued before its queries are made and waited for after (latent_route.py: with one
  document per row the gather less the future, with short documents a few fragments); each rank expands
  keys and values block by block for its own queries (ops.latent_attention: online softmax, the expansion
  recomputed in the backward), so any cp works and no rank holds the expanded K / V of the whole sequence.
- MLA, Ulysses style (parallel.cp_mla=ulysses): an all-to-all trades heads for positions, so each rank
  attends over the whole sequence (documents intact, in global order) with H / cp of the heads, and a
  second all-to-all trades back. Needs the heads on a tensor-parallel rank divisible by cp.
- KDA: each fragment's affine state summary (S_out = M S_in + B over its tokens, ops.kda) is all-gathered;
  every rank folds them in sequence order into its fragments' entry states, then runs its chunks from
  those. The short convolutions take their (kernel - 1)-position halo from the previous fragment. A
  document starting inside a fragment makes its M zero, so the state never crosses it; one starting
  exactly at a fragment's first position is handled by the chunked op's document masks.
Gradients flow back through the same collectives (all-gather <-> reduce-scatter, all-to-all <-> itself).
"""

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from moe_pretrain.model.layout import DocumentLayout
from parallel.collectives import RowExchange, all_gather_stacked, all_to_all_rows, finish_rows, start_rows
from parallel.latent_route import LatentRoute

StartedRows = tuple[torch.Tensor, RowExchange | None]
"""start_rows' output and exchange, for finish_rows."""


@dataclass(frozen=True)
class RouteOnDevice:
    """A LatentRoute with the index tensors its exchange uses, made once per forward on the latent's device."""

    route: LatentRoute
    send: torch.Tensor
    order: torch.Tensor
    fragments: torch.Tensor
    """route.needed: the rows of [B x 2 cp, F] the compact keys come from."""

    @staticmethod
    def of(route: LatentRoute, device: torch.device) -> "RouteOnDevice":
        def index(values: tuple[int, ...]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)
        return RouteOnDevice(route, index(route.send_slots), index(route.order), index(route.needed))


class NoContextParallel:
    """One rank holds every position (the identity)."""

    size = 1
    rank = 0
    exchanges_latent = False
    """MLA under cp: gather the latent (True) or trade heads for positions (False)."""

    def local(self, x_BT_: torch.Tensor) -> torch.Tensor:
        return x_BT_

    def pieces(self, x_BT_: torch.Tensor) -> torch.Tensor:
        return x_BT_

    def halo(self, x_BTC: torch.Tensor, width: int) -> None:
        """Nothing precedes a whole row."""
        return None

    def heads_to_sequence(self, x_BTHD: torch.Tensor) -> torch.Tensor:
        return x_BTHD

    def sequence_to_heads(self, x_BThD: torch.Tensor) -> torch.Tensor:
        return x_BThD

    def place(self, positions: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
        """Host positions in sequences of seq_len -> (the rank holding each, its index among the rank's
        positions of the row)."""
        return np.zeros_like(positions), positions

    def latent_route(self, layout: DocumentLayout, device: torch.device) -> RouteOnDevice:
        """This rank's latent exchange over the layout's documents (parallel/latent_route.py), worked out once
        per forward and shared by every MLA layer."""
        B, T = layout.position_in_doc.shape
        bounds = layout.document_bounds
        return layout.derived((self, "latent route"),
                              lambda: RouteOnDevice.of(LatentRoute.of(bounds, B, T, self.size, self.rank), device))

    def start_latent(self, x_BTC: torch.Tensor, route: RouteOnDevice) -> StartedRows:
        """Every position is here: nothing to send."""
        return x_BTC, None

    def finish_latent(self, x_BTC: torch.Tensor, started: StartedRows, route: RouteOnDevice) -> torch.Tensor:
        return x_BTC.flatten(0, 1)


def held_positions(x_BT_: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """[B, T, ...] (every position) -> [B, T / cp, ...]: cp rank `rank`'s two fragments (no communication)."""
    if cp == 1:
        return x_BT_
    T = x_BT_.shape[1]
    if T % (2 * cp):
        raise ValueError(f"sequence length {T} is not divisible by 2 x parallel.cp = {2 * cp}")
    fragments = x_BT_.unflatten(1, (2 * cp, T // (2 * cp)))
    return fragments[:, [rank, 2 * cp - 1 - rank]].flatten(1, 2)


@dataclass(frozen=True)
class _ScanRoute:
    """One round of the entry-state scan on one rank: which of its fragments' values it sends where, and which
    of its fragments each received value belongs to. Rows go to each destination ordered by the destination's
    slot and arrive from each source ordered by ours, so both ends agree without telling each other."""

    send_slots: tuple[int, ...]
    input_splits: list[int]
    output_splits: list[int]
    receive_slots: tuple[int, ...]

    @staticmethod
    def of(fragments: tuple[int, int], owner_slot: list[int], distance: int) -> "_ScanRoute":
        """The route by which each fragment j receives the value of fragment j - distance (owner_slot:
        ContextParallel's, global fragment -> 2 rank + slot)."""
        n = len(owner_slot)
        sends = sorted((divmod(owner_slot[j + distance], 2), slot) for slot, j in enumerate(fragments)
                       if j + distance < n)
        receives = sorted((owner_slot[j - distance] // 2, slot) for slot, j in enumerate(fragments) if j >= distance)
        input_splits, output_splits = [0] * (n // 2), [0] * (n // 2)
        for (rank, _), _ in sends:
            input_splits[rank] += 1
        for rank, _ in receives:
            output_splits[rank] += 1
        return _ScanRoute(tuple(slot for _, slot in sends), input_splits, output_splits,
                          tuple(slot for _, slot in receives))


SCAN_FROM_CP = 8
"""KDA's entry states by a scan from this cp on (ContextParallel.entry_states): below it the all-gather moves
about as many summaries (8 against the scan's 6 at cp 4) in one collective instead of 1 + log2(2 cp)."""


class ContextParallel(NoContextParallel):
    def __init__(self, group: dist.ProcessGroup, mla: str = "ulysses"):
        """mla: the resolved exchange (config/stage.mla_exchange): latent or ulysses."""
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.mla = mla
        self.exchanges_latent = mla == "latent"
        self.fragments = (self.rank, 2 * self.size - 1 - self.rank)
        # Global fragment j is slot owner_slot[j] of the stacked [rank, 2] local fragments.
        self.owner_slot = [2 * min(j, 2 * self.size - 1 - j) + (j >= self.size) for j in range(2 * self.size)]
        # The global fragments each rank holds, rank by rank: what sequence_to_heads sends where.
        self.held = [j for r in range(self.size) for j in (r, 2 * self.size - 1 - r)]
        self._scan_routes: dict[int, _ScanRoute] = {}

    def local(self, x_BT_: torch.Tensor) -> torch.Tensor:
        """[B, T, ...] (every position) -> [B, T / cp, ...] (this rank's two fragments)."""
        return held_positions(x_BT_, self.size, self.rank)

    def place(self, positions, seq_len):
        F = seq_len // (2 * self.size)
        fragment = positions // F
        second = fragment >= self.size  # the rank's second fragment, 2 cp - 1 - rank
        return np.where(second, 2 * self.size - 1 - fragment, fragment), np.where(second, F, 0) + positions % F

    def start_latent(self, x_BTC: torch.Tensor, route: RouteOnDevice) -> StartedRows:
        """Start sending the local fragments of x [B, T / cp, C] to the ranks that see them (route); finish_latent
        waits, so what runs between the two hides the exchange (and beside a pair, the other pass runs first)."""
        return start_rows(self.pieces(x_BTC).flatten(1)[route.send], route.route.output_splits,
                          route.route.input_splits, self.group)

    def finish_latent(self, x_BTC: torch.Tensor, started: StartedRows, route: RouteOnDevice) -> torch.Tensor:
        """The keys this rank's queries see, [len(needed) x F, C] in sequence order (differentiable: each
        fragment's gradient goes back to its owner and adds up there)."""
        local = self.pieces(x_BTC).flatten(1)
        return torch.cat([local, finish_rows(*started)])[route.order].reshape(-1, x_BTC.shape[-1])

    def pieces(self, x_BT_: torch.Tensor) -> torch.Tensor:
        """Local [B, T / cp, ...] -> [B * 2, F, ...]: each local fragment a row of its own."""
        return x_BT_.reshape(x_BT_.shape[0] * 2, x_BT_.shape[1] // 2, *x_BT_.shape[2:])

    def _global_order(self, stacked: torch.Tensor) -> torch.Tensor:
        """[cp, B, 2, ...] (every rank's fragments) -> [B, 2 cp, ...] in sequence order."""
        flat = stacked.movedim(0, 1).flatten(1, 2)  # [B, cp * 2, ...], index rank * 2 + slot
        return flat[:, self.owner_slot]

    def halo(self, x_BTC: torch.Tensor, width: int) -> torch.Tensor:
        """The `width` positions before each local fragment, from the fragment before it in the sequence
        (zeros before a row's start) -> [B * 2, width, C]; differentiable."""
        B = x_BTC.shape[0]
        tails = self.pieces(x_BTC)[:, -width:].unflatten(0, (B, 2))  # [B, 2, width, C]
        ordered = self._global_order(all_gather_stacked(tails, self.group))  # [B, 2 cp, width, C]
        before = torch.cat([torch.zeros_like(ordered[:, :1]), ordered[:, :-1]], dim=1)
        return before[:, list(self.fragments)].flatten(0, 1)

    def entry_states(self, M: torch.Tensor, Bs: torch.Tensor) -> torch.Tensor:
        """Each local fragment's KDA entry state from every fragment's summary.

        M [B * 2, H, K, K], Bs [B * 2, H, K, V] (local pieces) -> [B * 2, H, K, V]. The entry state of fragment
        j is what the summaries before it make of S_0 = 0 (a row starts a document), S_{j+1} = M_j S_j + B_j,
        in their own dtype (ops.kda keeps them in >= fp32). From cp = SCAN_FROM_CP on a scan (_scanned), below
        it one all-gather of every summary and a fold (_folded): the same states, the scan's bytes O(log cp)."""
        maps = torch.cat([M, Bs], dim=-1).unflatten(0, (-1, 2))  # [B, 2 (slot), H, K, K + V]
        scanned = self.size >= SCAN_FROM_CP
        return (self._scanned if scanned else self._folded)(maps, M.shape[-1]).flatten(0, 1)

    def _folded(self, maps: torch.Tensor, K: int) -> torch.Tensor:
        """Every summary gathered to every rank and folded in sequence order -> [B, 2, H, K, V]."""
        ordered = self._global_order(all_gather_stacked(maps, self.group))  # [B, 2 cp, H, K, K + V]
        # One unbind, not an index per fragment: each index's backward writes a zero tensor of all 2 cp
        # summaries, so the fold's backward would move O(cp^2) summaries' bytes.
        transitions, offsets = ordered[..., :K].unbind(1), ordered[..., K:].unbind(1)
        state = torch.zeros_like(offsets[0])
        entries = []
        for j in range(max(self.fragments) + 1):
            entries.append(state)
            state = transitions[j] @ state + offsets[j]
        return torch.stack([entries[j] for j in self.fragments], dim=1)

    def _scanned(self, maps: torch.Tensor, K: int) -> torch.Tensor:
        """A scan -> [B, 2, H, K, V]: each fragment first takes its predecessor's map, then log2(2 cp) rounds
        compose it with the running map of the fragment 1, 2, 4, ... before it (Hillis-Steele). Each round a
        rank sends and receives at most two summaries, (1 + log2(2 cp)) x 2 in all where the all-gather brings
        every rank 2 cp: 16 against 256 at cp 128, and a chain of 1 + log2(2 cp) compositions in place of 2 cp."""
        maps = maps.movedim(1, 0)  # [2 (slot), B, H, K, K + V]
        identity = torch.zeros_like(maps[0])
        identity[..., :K] = torch.eye(K, dtype=maps.dtype, device=maps.device)
        running = self._from_before(maps, 1, identity)  # fragment j: the map of j - 1 (identity for 0)
        distance = 1
        while distance < 2 * self.size:
            before = self._from_before(running, distance, identity)
            transition, offset = running[..., :K], running[..., K:]
            running = torch.cat([transition @ before[..., :K], transition @ before[..., K:] + offset], dim=-1)
            distance *= 2
        return running[..., K:].movedim(0, 1)

    def _from_before(self, values: torch.Tensor, distance: int, identity: torch.Tensor) -> torch.Tensor:
        """values [2, ...] of this rank's fragments (front, back) -> [2, ...] the values of the fragments
        `distance` before each in sequence order (identity where the sequence has none): one all-to-all along
        the round's route (_ScanRoute, made once per distance)."""
        if distance not in self._scan_routes:
            self._scan_routes[distance] = _ScanRoute.of(self.fragments, self.owner_slot, distance)
        route = self._scan_routes[distance]
        rows = values[list(route.send_slots)].flatten(1)
        received = all_to_all_rows(rows, route.output_splits, route.input_splits, self.group)
        out = [identity, identity]
        for row, slot in zip(received.unflatten(1, values.shape[1:]).unbind(0), route.receive_slots, strict=True):
            out[slot] = row
        return torch.stack(out)

    def heads_to_sequence(self, x_BTHD: torch.Tensor) -> torch.Tensor:
        """Local positions, all heads [B, T / cp, H, D] -> every position, H / cp heads [B, T, H / cp, D]."""
        B, T_local, H, D = x_BTHD.shape
        if H % self.size:
            raise ValueError(f"{H} attention heads on this rank are not divisible by parallel.cp={self.size}")
        send = x_BTHD.reshape(B, 2, T_local // 2, self.size, H // self.size, D).permute(3, 0, 1, 2, 4, 5)
        received = all_to_all_rows(send.reshape(self.size, -1), [1] * self.size, [1] * self.size, self.group)
        received = received.reshape(self.size, B, 2, T_local // 2, H // self.size, D)
        return self._global_order(received).flatten(1, 2)

    def sequence_to_heads(self, x_BThD: torch.Tensor) -> torch.Tensor:
        """The inverse of heads_to_sequence: [B, T, H / cp, D] -> [B, T / cp, H, D]."""
        B, T, h, D = x_BThD.shape
        fragments = x_BThD.unflatten(1, (2 * self.size, T // (2 * self.size)))
        send = fragments[:, self.held].unflatten(1, (self.size, 2)).movedim(1, 0)  # [cp(dest), B, 2, F, h, D]
        received = all_to_all_rows(send.reshape(self.size, -1), [1] * self.size, [1] * self.size, self.group)
        received = received.reshape(self.size, B, 2, T // (2 * self.size), h, D)  # [cp(head group), ...]
        return received.permute(1, 2, 3, 0, 4, 5).reshape(B, T // self.size, self.size * h, D)
