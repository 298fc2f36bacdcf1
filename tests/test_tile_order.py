"""The tile order inside a group (kernels/scheduler.py `TileScheduler.coords`, GemmConfig.band_m), on the CPU.

`coords` is plain arithmetic on the kernel's integers, so it runs here on Python ints: the same code the kernels
trace. GPU correctness (banded kernels bitwise equal to unbanded ones) is tests/test_band_gpu.py.
"""
import dataclasses
import itertools

import pytest

import fusion.kernels as K
from fusion.errors import KernelConfigError
from fusion.kernels.scheduler import TileScheduler
from fusion.kernels.tile_policy import BAND_L2_BYTES, band_for, one_band_limit, resolved_band


def _order(mt, n_units, band, one_band, cluster_n=1, rank=0):
    s = TileScheduler(128, n_units * cluster_n, 1, False, False, cluster_n, band, one_band)
    return [s.coords(t, 0, mt * n_units, rank) for t in range(mt * n_units)]


@pytest.mark.parametrize("mt,n_units,band,one_band", itertools.product((1, 2, 7, 8, 9, 17, 26, 64, 129), (1, 3, 14),
                                                                       (1, 3, 8, 16), (None, 24)))
def test_every_tile_once(mt, n_units, band, one_band):
    got = _order(mt, n_units, band, one_band)
    assert sorted(got) == [(m, n) for m in range(mt) for n in range(n_units)]


@pytest.mark.parametrize("mt", [1, 5, 8, 16, 24])
def test_a_group_within_the_one_band_limit_keeps_m_fastest(mt):
    """Every MoE group of up to one_band m-tiles walks as without bands: the change leaves them alone."""
    assert _order(mt, 6, 8, 24) == _order(mt, 6, 1, None) == [(t % mt, t // mt) for t in range(mt * 6)]


@pytest.mark.parametrize("mt,band,sizes", [(26, 8, [7, 7, 7, 5]), (26, 3, [3] * 8 + [2]), (128, 16, [16] * 8),
                                           (33, 16, [11, 11, 11]), (17, 16, [9, 8])])
def test_a_tall_group_is_cut_into_even_bands_walked_m_fastest(mt, band, sizes):
    n_units = 5
    order = _order(mt, n_units, band, band)
    start = 0
    for size in sizes:
        chunk = order[start * n_units:(start + size) * n_units]
        assert chunk == [(start + t % size, t // size) for t in range(size * n_units)]
        start += size
    assert start == mt


def test_pairs_take_neighbouring_n_tiles_of_the_banded_unit():
    units = _order(26, 3, 8, 8)
    for rank in (0, 1):
        assert _order(26, 3, 8, 8, cluster_n=2, rank=rank) == [(m, 2 * n + rank) for m, n in units]


@pytest.mark.parametrize("mt,band", [(1, 8), (2, 8), (7, 8), (26, 8), (33, 16)])
def test_m_pairs_take_neighbouring_m_tiles_of_one_n_tile(mt, band):
    """cluster_m = 2: a unit is two neighbouring m-tiles of one n-tile (one per rank); a group's odd last m-tile
    leaves rank 1 a tile one past the group (its rows are masked, nothing stored); bands count units."""
    n_units = 3
    units = -(-mt // 2)
    s = TileScheduler(128, n_units, 1, False, False, 1, band, band, cluster_m=2)
    walks = [[s.coords(t, 0, units * n_units, rank) for t in range(units * n_units)] for rank in (0, 1)]
    for (m0, n0), (m1, n1) in zip(*walks):
        assert m1 == m0 + 1 and n0 == n1 and m0 % 2 == 0
    tiles = sorted(walks[0] + walks[1])
    assert tiles == [(m, n) for m in range(2 * units) for n in range(n_units)]
    assert [t for t in tiles if t[0] >= mt] == ([(mt, n) for n in range(n_units)] if mt % 2 else [])
    with pytest.raises(AssertionError, match="along m or along n"):
        TileScheduler(128, 4, 1, False, False, 2, 1, None, cluster_m=2)


def test_band_policy():
    assert band_for(192) == band_for(256) == 16 and band_for(128) == band_for(64) == 8
    assert resolved_band(K.GemmConfig(tile_n=192)) == 16 and resolved_band(K.GemmConfig(tile_n=128)) == 8
    assert resolved_band(K.GemmConfig(tile_n=192, band_m=1)) == 1
    # the gathering kernel keeps m fastest (bands measured slower there); an explicit band still applies
    assert resolved_band(K.GemmConfig(tile_n=256, gather_a=True)) == 1
    assert resolved_band(K.GemmConfig(tile_n=256, gather_a=True, band_m=8)) == 8
    assert resolved_band(K.choose_fp8_config(4096, 7168, 32)) == 8
    # Mixtral's 2048-row groups (17 m-tiles) at K = 4096 stay one band; a dense 16k-row GEMM (128) is cut
    assert one_band_limit(16, 128, 4096, 2) == BAND_L2_BYTES // (128 * 4096 * 2) == 24
    assert one_band_limit(16, 128, 28672, 2) == 16
    assert one_band_limit(8, 128, 7168, 1) == 27


def test_kernel_names_say_the_band():
    epi = K.IdentityEpilogue()
    assert K.compile_grouped_gemm(K.GemmConfig(tile_n=128, stages=6, pingpong=True), epi, "bfloat16", 512, 256,
                                  4).name.endswith("s6_band8_pp")
    assert "_band" not in K.compile_grouped_gemm(K.GemmConfig(tile_n=128, stages=6, pingpong=True, band_m=1), epi,
                                               "bfloat16", 512, 256, 4).name


@pytest.mark.parametrize("compile_fn", ["bf16", "fp8"])
def test_a_negative_band_is_refused(compile_fn):
    epi = K.IdentityEpilogue()
    with pytest.raises(KernelConfigError, match="band_m"):
        if compile_fn == "bf16":
            K.compile_grouped_gemm(K.GemmConfig(tile_n=128, stages=6, pingpong=True, band_m=-1), epi, "bfloat16",
                                   512, 256, 4)
        else:
            cfg = K.choose_fp8_config(1024, 512, 4)
            K.compile_fp8_grouped_gemm(K.GemmConfig(**{**cfg.__dict__, "band_m": -1}), epi, 1024, 512, 4)


def test_fusion_tile_band_sets_every_job_band(monkeypatch):
    """FUSION_TILE_BAND (read at import into fusion.runtime.kernel.TILE_BAND) is the A/B switch: it lands in the
    job's configuration, so the two orders get different cache keys."""
    import torch

    from fusion.runtime import kernel
    from fusion.runtime.kernel import IDENTITY_SOURCE, make_job

    def band_of(job):
        return K.GemmConfig(*job.config).band_m

    args = (IDENTITY_SOURCE, torch.bfloat16, 4096, 4096, 1, False, "K", False, "s", "v")
    default = make_job(*args)
    fp8 = make_job(*args, mainloop="fp8_block")
    assert band_of(default) == 0 and band_of(fp8) == 0
    monkeypatch.setattr(kernel, "TILE_BAND", "1")
    assert band_of(make_job(*args)) == 1 and band_of(make_job(*args, mainloop="fp8_block")) == 1
    assert make_job(*args).key != default.key


# ---------------------------------------------------------------------------------------------------------------
# split launches (GemmConfig.split): a 128-row head kernel and a 64-row tail kernel share each group


def _split_rows(rows):
    """The rows of a group of `rows` rows each kernel of a split launch covers: (head rows, tail rows), as lists."""
    head = TileScheduler(128, 1, 1, False, True, split="head")
    tail = TileScheduler(64, 1, 1, False, True, split="tail")
    head_rows = [r for m in range(head.m_units(rows)) for r in range(m * 128, min(m * 128 + 128, rows))]
    tail_rows = [r for m in range(tail.m_units(rows))
                 for r in range((tail.first_m(rows) + m) * 64, min((tail.first_m(rows) + m + 1) * 64, rows))]
    return head, tail, head_rows, tail_rows


@pytest.mark.parametrize("rows", list(range(0, 400)) + [1000, 1023, 1024, 1025, 1088, 1089, 4097])
def test_a_split_covers_every_row_of_a_group_once(rows):
    head, tail, head_rows, tail_rows = _split_rows(rows)
    assert sorted(head_rows + tail_rows) == list(range(rows))
    r = rows % 128
    assert tail.m_units(rows) == (1 if 0 < r <= 64 else 0)    # the tail kernel: a short last tile, or nothing
    assert len(tail_rows) == (r if 0 < r <= 64 else 0)
    whole = -(-rows // 128)
    assert head.m_units(rows) == (whole - 1 if 0 < r <= 64 else whole)


def test_the_split_policy():
    from fusion.kernels.tile_policy import GemmConfig, split_problem, split_tails, tail_config, tile_config

    base = GemmConfig(tile_n=192, stages=5, pingpong=True, dynamic=True)
    assert split_tails(base, 128).split == "head"
    assert split_tails(base, 1).split == ""                                    # a dense GEMM: one group
    assert split_tails(dataclasses.replace(base, cluster_m=2), 32).split == ""  # m-pairs keep every tile
    assert split_tails(dataclasses.replace(base, tile_m=64), 32).split == ""
    tail = tail_config(split_tails(base, 128))
    assert (tail.tile_m, tail.tile_n, tail.split, tail.dynamic, tail.pingpong, tail.cluster_n) == \
        (64, 192, "tail", False, True, 1)
    assert split_problem(tail) is None and split_problem(split_tails(base, 128)) is None
    assert "tile_m = 128" in split_problem(dataclasses.replace(base, tile_m=64, split="head"))
    assert "tile_m = 64" in split_problem(dataclasses.replace(base, split="tail"))
    assert "one of" in split_problem(dataclasses.replace(base, split="middle"))
    # every grouped job of the policy splits; a dense one does not
    assert GemmConfig(*tile_config(1536, 2048, 128, True, "K", False)).split == "head"
    assert GemmConfig(*tile_config(1536, 2048, 128, False, "K", True, gather=True)).split == "head"
    assert GemmConfig(*tile_config(14336, 4096, 1, True, "K", False)).split == ""


def test_a_head_job_has_its_tail_job_as_companion():
    import torch

    from fusion.runtime.compile import companion_jobs, with_companions
    from fusion.runtime.kernel import IDENTITY_SOURCE, make_job
    from fusion.kernels.tile_policy import GemmConfig

    job = make_job(IDENTITY_SOURCE, torch.bfloat16, 2048, 768, 128, False, "K", False, "lone_fprop", "identity")
    (tail,) = companion_jobs(job)
    assert GemmConfig(*tail.config).split == "tail" and tail.key != job.key
    assert companion_jobs(tail) == []
    assert [j.key for j in with_companions([job, tail, job])] == [job.key, tail.key]
    dense = make_job(IDENTITY_SOURCE, torch.bfloat16, 2048, 768, 1, False, "K", False, "lone_fprop", "identity")
    assert companion_jobs(dense) == []


@pytest.mark.parametrize("split,tile_m", [("head", 64), ("tail", 128), ("sideways", 128)])
def test_a_bad_split_is_refused(split, tile_m):
    cfg = K.GemmConfig(tile_m=tile_m, tile_n=128, stages=6, pingpong=True, split=split)
    with pytest.raises(KernelConfigError, match="split"):
        K.check_config(cfg, K.IdentityEpilogue(), "bfloat16", 512, 256)
