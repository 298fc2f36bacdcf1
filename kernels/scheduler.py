"""Device tile scheduler of the grouped GEMM: which (group, m-tile, n-tile) a warpgroup works on next.

Tiles are numbered group by group; within a group m runs fastest, then n. A cursor ``(g, base, cnt)`` =
(group, id of the group's first tile, tiles in the group) is moved forward to a tile id by reading the
device ``offsets`` (no host sync, so one compile serves every batch and every ``group_sizes``).

With ``cluster_n = 2`` the schedule's unit is an n-tile *pair* of one m-tile, worked by a CTA pair (one
cluster); with ``cluster_m = 2`` it is an m-tile pair of one n-tile (a group's m-tiles in twos; where a group has
an odd count, rank 1's half of its last unit lies past the group's rows: every row masked, nothing stored). The
walks below then run over clusters (``bidx`` = the cluster's index, ``grid`` = clusters) and :meth:`coords` turns
a unit into the tile of the CTA of rank ``rank`` in the pair. A dynamic pair must agree
on every unit: the producer warp of rank 0 takes the ids from the counter and sends each one to rank 1's
producer warp through a mailbox (:class:`PeerMailbox`: ``st.async`` into the peer's smem, completing on the
peer's mbarrier); each CTA then publishes the ids to its own consumers as above.

- static: the tile ids of CTA ``b`` are ``b, b + grid, b + 2 grid, ...``;
- dynamic: the producer warp takes the next id from a global atomic counter and publishes it to the
  consumer warpgroups through a small smem pipeline (``sTile`` slots guarded by mbarriers).

Pingpong consumers own every other tile of their CTA's sequence: warpgroup ``w`` takes entries
``w, w + 2, ...``. The producer then publishes one extra end-of-work entry, so the warpgroup that skips
the last real entry also reads an end marker.

Methods are ``@cute.jit`` helpers inlined into the kernel; they return the pipeline state they advanced,
so the caller's loops carry it (a state only passed as an argument would not be seen as loop-carried).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

_NO_GROUP = 1 << 30  # tile count of the groups past the last one: the cursor stops there
PEER_SLOTS = 4       # the CTA pair's mailbox depth (rank 0 runs at most this many tile ids ahead of rank 1)
ID_BYTES = 4



def multicast_mask(ctas: int, rank):
    """The TMA multicast mask of a box that CTA ``rank`` of a ``ctas``-CTA cluster (a CTA pair) loads for all of them;
    None for one CTA (no multicast)."""
    if cutlass.const_expr(ctas == 1):
        return None
    return cute.make_layout_image_mask(cute.make_layout((ctas, 1, 1)), (rank, 0, 0), mode=0)

class PeerMailbox:
    """Rank 0's producer warp hands tile ids to rank 1's (a dynamic CTA pair). Message k goes to slot
    ``k % PEER_SLOTS``; ``full[i]`` (armed by rank 1 with the 4 bytes it expects, completed by rank 0's
    ``st.async``) and ``empty[i]`` (released by rank 1 with a remote arrive on rank 0's barrier) are in both CTAs'
    smem, each used on one side. ``bars``: 2 x PEER_SLOTS mbarriers (full, then empty); ``slots``: PEER_SLOTS
    Int32."""

    def __init__(self, bars, slots):
        self.bars = bars
        self.slots = slots

    @cute.jit
    def init(self):
        """In the prologue (before the cluster's barrier sync): one thread initializes the barriers."""
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            with cute.arch.elect_one():
                for i in cutlass.range_constexpr(2 * PEER_SLOTS):
                    cute.arch.mbarrier_init(self.bars + i, 1)
        cute.arch.mbarrier_init_fence()

    @cute.jit
    def exchange(self, k: Int32, tile_id: Int32, rank: Int32) -> Int32:
        """Message ``k`` of the producer warps (every lane): rank 0 sends ``tile_id`` once rank 1 has read the
        slot's previous message; rank 1 receives it, gives the slot back, and returns it (rank 0 returns its own).
        One straight-line body, predicated on the rank."""
        i = k % PEER_SLOTS
        sender = rank == 0
        lane0 = cute.arch.lane_idx() == 0
        if lane0 & (rank != 0):
            cute.arch.mbarrier_arrive_and_expect_tx(self.bars + i, ID_BYTES)
        # rank 0 waits for the slot to be empty (the first round passes), rank 1 for it to be full
        ring = (k // PEER_SLOTS) & 1
        cute.arch.mbarrier_wait(self.bars + cutlass.select_(sender, PEER_SLOTS + i, i),
                                cutlass.select_(sender, ring ^ 1, ring))
        if lane0 & sender:
            cute.arch.store_async_dsmem(self.slots.iterator + i, tile_id, self.bars + i, 1)
        got = self.slots[i]
        cute.arch.sync_warp()
        if lane0 & (rank != 0):
            cute.arch.mbarrier_arrive(self.bars + PEER_SLOTS + i, 0)
        return cutlass.select_(sender, tile_id, got)

    @cute.jit
    def drain(self, sent: Int32, rank: Int32):
        """Rank 0's producer warp, after its last message: wait until rank 1 has given back every slot still
        out (the last ``PEER_SLOTS`` messages), so that no remote arrive reaches this CTA's smem after it exits."""
        if rank == 0:
            for j in cutlass.range_constexpr(PEER_SLOTS):
                k = sent - 1 - j
                if k >= 0:
                    cute.arch.mbarrier_wait(self.bars + PEER_SLOTS + k % PEER_SLOTS, (k // PEER_SLOTS) & 1)


def _select(cond, a, b):
    """a where cond else b: a DSL select on device values, Python's on Python values (the CPU tests walk the order
    with ints)."""
    if isinstance(cond, bool):
        return a if cond else b
    return cutlass.select_(cond, a, b)


class TileScheduler:
    """Trace-time description of the tile order: ``tile_m`` rows per m-tile, ``n_tiles`` n-tiles per
    group (compile-time, from N), ``G`` groups (compile-time), ``cluster_n`` neighbouring n-tiles per unit
    (one per CTA of a cluster; ``n_tiles`` must be a multiple of it) or ``cluster_m`` neighbouring m-tiles of
    one group (the bands then count m-tile units)."""

    def __init__(self, tile_m: int, n_tiles: int, G: int, dynamic: bool, pingpong: bool, cluster_n: int = 1,
                 band_m: int = 1, one_band: int | None = None, cluster_m: int = 1):
        assert n_tiles % cluster_n == 0, "a cluster's CTAs take whole n-tiles: n_tiles % cluster_n == 0"
        assert band_m >= 1, "band_m: m-tiles per band, at least 1"
        assert cluster_m == 1 or cluster_n == 1, "a cluster pairs CTAs along m or along n, not both"
        self.tile_m = tile_m
        self.cluster_m = cluster_m
        self.band_m = band_m
        self.one_band = band_m if one_band is None else max(one_band, band_m)
        self.cluster_n = cluster_n
        self.n_units = n_tiles // cluster_n     # schedule units along n
        self.G = G
        self.dynamic = dynamic
        self.pingpong = pingpong

    # ---------------------------------------------------------------- cursor over the groups
    @cute.jit
    def group_tiles(self, mOffs: cute.Tensor, g: Int32) -> Int32:
        """Schedule units of group ``g`` (a huge count past the last group, which ends every walk there): its
        m-tiles (in units of ``cluster_m``) times the n units."""
        gi = cutlass.min(g, self.G - 1)
        rows = mOffs[gi + 1] - mOffs[gi]
        unit_rows = self.tile_m * self.cluster_m
        cnt = ((rows + (unit_rows - 1)) // unit_rows) * self.n_units
        return cutlass.select_(g < self.G, cnt, Int32(_NO_GROUP))

    @cute.jit
    def seek(self, mOffs: cute.Tensor, tile_id: Int32, g: Int32, base: Int32, cnt: Int32):
        """Move the cursor forward to the group holding ``tile_id`` (``g == G`` when there is none)."""
        while tile_id >= base + cnt:
            base = base + cnt
            g = g + 1
            cnt = self.group_tiles(mOffs, g)
        return g, base, cnt

    @cute.jit
    def start(self, mOffs: cute.Tensor, tile_id: Int32):
        """A cursor at group 0, moved to ``tile_id``."""
        g = Int32(0)
        base = Int32(0)
        cnt = self.group_tiles(mOffs, g)
        g, base, cnt = self.seek(mOffs, tile_id, g, base, cnt)
        return g, base, cnt

    def coords(self, tile_id, base, cnt, rank=0):
        """(m_idx, n_idx) of ``tile_id`` inside its group; with clusters, the tile of the CTA of rank ``rank``
        in its cluster (``cluster_n``: its n-tile of the unit's pair; ``cluster_m``: its m-tile).

        Banded order (L2 reuse; ``band_m`` > 1): a group of more than ``one_band`` m-tiles is cut into the fewest
        bands of at most ``band_m`` m-tiles, of equal size but the last (which may be shorter); the bands run one
        after another, and inside a band m runs fastest, then n. Any other group (every MoE group up to
        ``one_band * tile_m`` rows) is one band: m fastest, then n, as without bands. Why: with m fastest over a
        tall group (a dense GEMM: 128 m-tiles at 16k rows), the CTAs running at one time cover every m-tile of one
        or two n-tiles, so every n-tile re-reads all of A from DRAM (A does not fit in L2); inside a band, the CTAs
        running together share ``band_m`` A tiles and a few B tiles, each read from DRAM about once per band."""
        local = tile_id - base
        mt = cnt // self.n_units
        if cutlass.const_expr(self.band_m > 1):
            bands = (mt + (self.band_m - 1)) // self.band_m
            size = _select(mt > self.one_band, (mt + bands - 1) // bands, mt)   # m-tiles per band
            band_tiles = size * self.n_units
            band = local // band_tiles
            within = local - band * band_tiles
            rows = cutlass.min(mt - band * size, size)   # m-tiles of this band (the last may have fewer)
            m_idx = band * size + within % rows
            n_idx = within // rows
        else:
            m_idx = local % mt
            n_idx = local // mt
        if cutlass.const_expr(self.cluster_n > 1):
            n_idx = n_idx * self.cluster_n + rank
        if cutlass.const_expr(self.cluster_m > 1):
            m_idx = m_idx * self.cluster_m + rank
        return m_idx, n_idx

    # ---------------------------------------------------------------- next tile id
    @cute.jit
    def producer_next(self, mCounter: cute.Tensor, tile_id: Int32, grid: Int32, mailbox=None, rank=0,
                      k=0) -> Int32:
        """The producer warp's next tile id: from the atomic counter (dynamic; lane 0 takes it and the
        warp shares it) or ``grid`` further (static). A dynamic CTA pair: rank 0 takes it and sends it as
        message ``k`` of ``mailbox``; rank 1 receives it."""
        nxt = tile_id + grid
        if cutlass.const_expr(self.dynamic):
            nt = Int32(0)
            if cute.arch.lane_idx() == rank * 32:   # lane 0; in a pair, of rank 0 only
                nt = cute.arch.atomic_add(mCounter.iterator.llvm_ptr, Int32(1)) + grid
            nxt = cute.arch.shuffle_sync(nt, 0)
            if cutlass.const_expr(self.cluster_n * self.cluster_m > 1):
                nxt = mailbox.exchange(k, nxt, rank)
        return nxt

    @cute.jit
    def publish(self, sched_pipe, state, sTile: cute.Tensor, tile_id: Int32):
        """Producer warp: hand ``tile_id`` to the consumer warpgroups (dynamic scheduler)."""
        self.fill_slot(sched_pipe, state, sTile, tile_id)
        state.advance()
        return state

    @cute.jit
    def fill_slot(self, sched_pipe, state, sTile: cute.Tensor, tile_id: Int32):
        """Producer warp: write ``tile_id`` into the state's slot once the consumers are done with it, and commit
        it; the caller advances the state (the gathering producer's other warps advance their copies too)."""
        sched_pipe.producer_acquire(state)
        if cute.arch.lane_idx() == 0:
            sTile[state.index] = tile_id
        sched_pipe.producer_commit(state)

    @cute.jit
    def receive(self, sched_pipe, state, sTile: cute.Tensor):
        """Consumer: the next published tile id."""
        sched_pipe.consumer_wait(state)
        tile_id = sTile[state.index]
        sched_pipe.consumer_release(state)
        state.advance()
        return tile_id, state

    @cute.jit
    def skip(self, sched_pipe, state):
        """Consumer: pass over one published entry (the other pingpong warpgroup's tile)."""
        sched_pipe.consumer_wait(state)
        sched_pipe.consumer_release(state)
        state.advance()
        return state

    def first_static(self, bidx, grid, cwg=None):
        """Static scheduler: a consumer warpgroup's first tile id (pingpong: ``cwg`` = its parity in the
        CTA's tile sequence)."""
        return bidx + cwg * grid if self.pingpong else bidx

    def next_static(self, tile_id, grid):
        """Static scheduler: a consumer warpgroup's tile id after ``tile_id``."""
        return tile_id + (2 * grid if self.pingpong else grid)

    @cute.jit
    def first_dynamic(self, sched_pipe, state, sTile: cute.Tensor, cwg):
        """Dynamic scheduler: a consumer warpgroup's first tile id (pingpong: ``cwg`` = its parity)."""
        tile_id, state = self.receive(sched_pipe, state, sTile)
        if cutlass.const_expr(self.pingpong):
            # warpgroup 1 skips entry 0 (warpgroup 0's tile) and takes entry 1
            t1 = tile_id
            if cwg == 1:
                sched_pipe.consumer_wait(state)
                t1 = sTile[state.index]
                sched_pipe.consumer_release(state)
            state.advance(cwg)
            tile_id = cutlass.select_(cwg == 1, t1, tile_id)
        return tile_id, state

    @cute.jit
    def next_dynamic(self, sched_pipe, state, sTile: cute.Tensor):
        """Dynamic scheduler: a consumer warpgroup's next tile id (pingpong: skips the other's entry)."""
        if cutlass.const_expr(self.pingpong):
            state = self.skip(sched_pipe, state)
        tile_id, state = self.receive(sched_pipe, state, sTile)
        return tile_id, state
