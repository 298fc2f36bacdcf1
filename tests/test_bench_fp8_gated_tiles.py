"""bench/fp8_gated_tiles.py on the CPU: its two tiles are the old gated policy's and the n-waves', never the same
kernel twice (its second H100 run timed the n-waves twice once the n-waves had become the policy), and the switch
it flips is restored."""
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import fp8_gated_tiles  # noqa: E402


def test_the_two_tiles_differ_on_every_shape():
    from fusion.kernels import tile_policy

    before = tile_policy.FP8_GATED_WAVES
    for name, E, Kd, N, _ in fp8_gated_tiles.SHAPES:
        policy, waves = fp8_gated_tiles.tiles(N, Kd, E)
        assert (waves.tile_m, waves.tile_n) == (128, 256), name
        assert (policy.tile_m, policy.tile_n) != (128, 256), name
    assert tile_policy.FP8_GATED_WAVES == before
