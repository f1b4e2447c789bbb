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


def cosine_matrix(a: Tensor, b: Tensor) -> Tensor:
    """Cosine similarities (float64) between the rows of ``a`` and ``b``."""
    a = torch.nn.functional.normalize(a.double(), dim=1)
    b = torch.nn.functional.normalize(b.double(), dim=1)
    return a @ b.T


def identity_retrieval(features: Tensor, labels: Tensor, identity: int, *, normalize: bool = True) -> dict[str, float]:
    """Retrieval of one identity (e.g. a person asked to be forgotten), leave one out: each of its images is a
    query against every other image of the set (its other images are the relevant ones). mAP and rank-1 in
    percent over its queries (``retrieval_metrics``'s definitions); ``queries`` = its images (none: NaN)."""
    labels = torch.as_tensor(labels)
    mine = torch.nonzero(labels == int(identity)).flatten()
    if len(mine) < 2:
        return {"mAP": float("nan"), "rank1": float("nan"), "queries": 0}
    dist = pairwise_distance(features[mine], features, normalize=normalize).numpy()
    ids = labels.numpy()
    aps, top1 = [], []
    for row, q in enumerate(mine.tolist()):
        keep = np.ones(len(ids), dtype=bool)
        keep[q] = False
        order = np.argsort(dist[row][keep], kind="stable")
        relevant = (ids[keep] == int(identity))[order]
        aps.append(average_precision(relevant))
        top1.append(float(relevant[0]))
    return {"mAP": 100.0 * float(np.mean(aps)), "rank1": 100.0 * float(np.mean(top1)), "queries": len(aps)}


def verification_scores(features: Tensor, labels: Tensor, identity: int, *, far: float = 0.01) -> dict[str, float]:
    """Face/person verification for one identity. Genuine pairs: every pair of its images; impostor pairs:
    every pair of images of two different identities in the set (all of them: the operating threshold is the
    system's, not the person's). ``threshold``: the cosine similarity that accepts a share ``far`` of the
    impostor pairs (false accept rate); ``TAR``: the share of the identity's genuine pairs accepted at it, in
    percent; ``genuine_cos``: their mean cosine similarity; ``impostor_cos``: the mean over its impostor pairs."""
    labels = torch.as_tensor(labels)
    sim = cosine_matrix(features, features)
    same = labels.view(-1, 1) == labels.view(1, -1)
    upper = torch.triu(torch.ones_like(same), diagonal=1)
    impostor = sim[upper & ~same]
    mine = labels == int(identity)
    genuine = sim[upper & same & mine.view(-1, 1) & mine.view(1, -1)]
    own_impostor = sim[mine][:, ~mine]
    if len(impostor) == 0 or len(genuine) == 0:
        return {"genuine_cos": float("nan"), "impostor_cos": float("nan"), "TAR": float("nan"),
                "threshold": float("nan"), "far": far, "genuine_pairs": int(len(genuine))}
    threshold = float(torch.quantile(impostor, 1.0 - far)) if len(impostor) < 16_000_000 else float(
        torch.sort(impostor).values[int((1.0 - far) * (len(impostor) - 1))])
    return {"genuine_cos": float(genuine.mean()), "impostor_cos": float(own_impostor.mean()),
            "TAR": 100.0 * float((genuine >= threshold).double().mean()), "threshold": threshold, "far": far,
            "genuine_pairs": int(len(genuine))}


def membership_gap(train_features: Tensor, heldout_features: Tensor) -> float:
    """Membership of an identity's training images in the embedding: mean cosine similarity of its training
    images to the centre of its held-out images, minus the mean (leave-one-out) similarity of the held-out
    images to that centre. About 0 for a model that never trained on those images (they are just more draws
    of the person); positive where training pulled them together."""
    if len(train_features) == 0 or len(heldout_features) < 2:
        return float("nan")
    held = torch.nn.functional.normalize(heldout_features.double(), dim=1)
    train = torch.nn.functional.normalize(train_features.double(), dim=1)
    centre = held.mean(0)
    loo = (held.sum(0, keepdim=True) - held) / (len(held) - 1)
    heldout_sim = torch.nn.functional.cosine_similarity(held, loo, dim=1).mean()
    train_sim = torch.nn.functional.cosine_similarity(train, centre.view(1, -1), dim=1).mean()
    return float(train_sim - heldout_sim)
