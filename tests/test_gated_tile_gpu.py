"""The gated FC1 forward's CTA pairs on a Hopper GPU (kernels/tile_policy.gated_tile): a block whose FC1 takes each
branch of the rule (128x192 pairs past 32 groups, 128x176 pairs at f = 1408, 128x256 cooperative pairs at
K >= 3072) computes the reference's outputs and gradients, with ragged and empty groups, and the F1 kernel that
launched was built at that tile (a fallback to another tile would pass the numerics and test nothing)."""
import pytest
import torch

import fusion
from conftest import launched_f1_config
from fusion import GroupLinear, Scale, SwiGLU
from test_fused_gpu import ragged_sizes, rel, run_both  # noqa: F401
from test_fused_gpu import _hopper_and_poison  # noqa: F401  (its autouse fixture: Hopper + poison)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("E,d,f,M,tile", [
    (64, 256, 384, 5003, (192, True)),     # 4 n-tiles of 192 at 64 groups (single CTAs before)
    (8, 256, 1408, 3001, (176, True)),     # f = 1408: 16 n-tiles of 176
    (4, 3072, 1024, 2000, (256, False)),   # 11 n-tiles at 192, 8 at 256, K = 3072
])
def test_the_gated_tile_pairs_compute_the_reference(E, d, f, M, tile, dtype):
    torch.manual_seed(0)
    block = fusion.Sequential(GroupLinear(E, d, 2 * f), SwiGLU(), Scale(), GroupLinear(E, f, d)).to("cuda", dtype)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=d ** -0.5 if p.shape[-1] == d else f ** -0.5)
    sizes = ragged_sizes(E, M).cuda()
    x = torch.randn(M, d, device="cuda", dtype=dtype)
    probs = torch.rand(M, device="cuda", dtype=dtype)
    (y, g), (y_ref, g_ref) = run_both(block, x, {"group_sizes": sizes, "scale": probs})
    cfg = launched_f1_config(block, dtype)
    assert (cfg.tile_n, cfg.pingpong, cfg.cluster_n, cfg.dynamic) == (*tile, 2, True), cfg
    assert rel(y, y_ref) < 1e-2
    for name, ref in g_ref.items():
        assert ref is None or rel(g[name], ref) < 2e-2, name
