"""Parameter-slice selection: L-CODEC and L-FOCI (pure torch, CPU or CUDA).

    codec(y, z, x=None, *, generator=None) -> 0-dim float64 tensor   T(Y, Z | X)
    codec_scores(y, z, x=None, *, generator=None) -> (S,) float64     T(Y, Z_j | X) per column
    lfoci(y, z, *, max_picks=None, generator=None) -> FociResult       forward selection
    lcodec_jitter(t, generator) -> tensor                              the L-CODEC tie-breaking noise

Sources: Azadkia & Chatterjee, "A simple measure of conditional dependence" (Ann. Statist.
2021); Mehta, Pal, Singh, Ravi, "Deep Unlearning via Randomized Conditionally Independent
Hessians" (CVPR 2022).
"""
from pipeline.selection.codec import codec, codec_scores, lcodec_jitter, rank_stats
from pipeline.selection.foci import FociResult, lfoci

__all__ = ["FociResult", "codec", "codec_scores", "lcodec_jitter", "lfoci", "rank_stats"]
