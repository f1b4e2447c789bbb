"""Retrieval metrics for person re-ID: mean average precision (mAP) and rank-1 (CMC@1).

For each query q: rank the gallery by distance to q (Euclidean on L2-normalised features by
default, i.e. a monotone function of cosine similarity). Following the Market-1501 protocol
(Zheng et al., ICCV 2015) gallery items of the same identity *and* the same camera as q are
removed (when cameras are given). With the ranked relevance list r_1..r_G (1 = same identity)
and R = sum_j r_j:
  AP(q)   = (1/R) sum_{j : r_j = 1} (#relevant in the top j) / j
  rank-1  = [r_1 = 1]
mAP and rank-1 are means over the queries with R > 0, in percent.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


def pairwise_distance(query: Tensor, gallery: Tensor, *, normalize: bool = True) -> Tensor:
    q, g = query.double(), gallery.double()
    if normalize:
        q = torch.nn.functional.normalize(q, dim=1)
        g = torch.nn.functional.normalize(g, dim=1)
    return torch.cdist(q, g)


def average_precision(relevant_sorted: np.ndarray) -> float:
    """AP of one ranked 0/1 relevance list."""
    hits = np.flatnonzero(relevant_sorted)
    if len(hits) == 0:
        return float("nan")
    return float(np.mean(np.arange(1, len(hits) + 1) / (hits + 1)))


def retrieval_metrics(
    query: Tensor, query_ids: Tensor, gallery: Tensor, gallery_ids: Tensor, *,
    query_cams: Tensor | None = None, gallery_cams: Tensor | None = None, normalize: bool = True,
) -> dict[str, float]:
    """mAP and rank-1 (percent) plus the number of valid queries."""
    dist = pairwise_distance(query, gallery, normalize=normalize).numpy()
    qids, gids = query_ids.numpy(), gallery_ids.numpy()
    aps, top1 = [], []
    for i in range(len(qids)):
        keep = np.ones(len(gids), dtype=bool)
        if query_cams is not None and gallery_cams is not None:
            keep = ~((gids == qids[i]) & (gallery_cams.numpy() == query_cams[i].item()))
        order = np.argsort(dist[i][keep], kind="stable")
        relevant = (gids[keep] == qids[i])[order]
        if not relevant.any():
            continue
        aps.append(average_precision(relevant))
        top1.append(float(relevant[0]))
    if not aps:
        return {"mAP": float("nan"), "rank1": float("nan"), "queries": 0}
    return {"mAP": 100.0 * float(np.mean(aps)), "rank1": 100.0 * float(np.mean(top1)), "queries": len(aps)}


def query_gallery_split(labels: Tensor, queries_per_id: int = 1) -> tuple[Tensor, Tensor]:
    """Positions: the first ``queries_per_id`` samples of each identity are queries, the rest gallery."""
    query, gallery = [], []
    seen: dict[int, int] = {}
    for pos, label in enumerate(labels.tolist()):
        if seen.get(label, 0) < queries_per_id:
            query.append(pos)
            seen[label] = seen.get(label, 0) + 1
        else:
            gallery.append(pos)
    return torch.as_tensor(query, dtype=torch.long), torch.as_tensor(gallery, dtype=torch.long)
