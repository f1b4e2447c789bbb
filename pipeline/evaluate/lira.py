"""Per-example likelihood-ratio membership attack (LiRA) and its unlearning use (U-LiRA).

Carlini et al., "Membership Inference Attacks From First Principles", IEEE S&P 2022:
  statistic      phi(x, y) = log(p_y / (1 - p_y)) = z_y - logsumexp_{k != y} z_k   (from logits z)
  shadows        models trained with x ("in") and without x ("out")
  fit            phi_in ~ N(mu_in, s_in^2), phi_out ~ N(mu_out, s_out^2), per example
  score          Lambda(x) = log N(phi_target; mu_in, s_in^2) - log N(phi_target; mu_out, s_out^2)
                 Lambda > 0: the target looks like a model trained on x.
With few shadows the per-example variances are unreliable; ``fixed_variance=True`` uses one
pooled variance per side for all examples (the paper's "global variance" variant).

Unlearning (Hayes et al., "Inexact Unlearning Needs More Careful Evaluations to Avoid a False
Sense of Privacy", 2024, U-LiRA; small-scale version): shadows are trained on D_r plus a random
half of D_f (each forget example is "in" for exactly half of the shadows), the unlearned target
is scored on every forget example. A perfect unlearning gives scores like a model that never
saw D_f (member rate ~ the out-model rate); a failed one gives Lambda > 0 on many forget samples.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from pipeline.data.sampleset import SampleSet
from pipeline.evaluate.predict import logits_of
from pipeline.tasks import Task

LOG_2PI = math.log(2 * math.pi)


def logit_confidence(logits: Tensor, y: Tensor) -> np.ndarray:
    """phi = z_y - logsumexp_{k != y} z_k (= logit of the softmax probability of y), float64 (``logit_parts``)."""
    parts = logit_parts(logits, y)
    return parts["label"] - parts["others"]


def logit_parts(logits: Tensor, y: Tensor) -> dict[str, np.ndarray]:
    """phi's two parts, float64: ``label`` z_y and ``others`` logsumexp_{k != y} z_k (phi = label - others)."""
    z = logits.double()
    idx = y.long().view(-1, 1)
    return {"label": z.gather(1, idx).squeeze(1).numpy(),
            "others": torch.logsumexp(z.scatter(1, idx, float("-inf")), dim=1).numpy()}


def statistic_shift(unlearned: np.ndarray, retrained: np.ndarray, *, min_var: float = 1e-4) -> dict[str, float]:
    """What separates two (S, N) statistics: ``shift`` = mean_n (mu_u(n) - mu_r(n)) (the means over the S
    models), ``std_unlearned`` / ``std_retrained`` the spread of each around its per-example mean (pooled over
    examples and all S models, floored at sqrt(min_var): the fixed variances ``ulira_attack_accuracy`` fits on
    S - 1 of them), ``shift_in_std`` = shift / std_retrained, and ``shift_spread`` the std over examples of
    mu_u(n) - mu_r(n) (a shift common to every example against one that differs)."""
    u, r = np.asarray(unlearned, dtype=np.float64), np.asarray(retrained, dtype=np.float64)
    gap = u.mean(0) - r.mean(0)
    std_u = math.sqrt(max(float(((u - u.mean(0)) ** 2).mean()), min_var))
    std_r = math.sqrt(max(float(((r - r.mean(0)) ** 2).mean()), min_var))
    return {"shift": float(gap.mean()), "shift_spread": float(gap.std()), "std_unlearned": std_u,
            "std_retrained": std_r, "shift_in_std": float(gap.mean()) / std_r}


def _log_normal(x: np.ndarray, mu: np.ndarray, var: np.ndarray) -> np.ndarray:
    return -0.5 * (LOG_2PI + np.log(var) + (x - mu) ** 2 / var)


def gaussian_llr(
    target: np.ndarray, in_stats: np.ndarray, out_stats: np.ndarray, in_mask: np.ndarray, *,
    fixed_variance: bool = True, min_var: float = 1e-4,
) -> np.ndarray:
    """Per-example log-likelihood ratio.

    target (N,), in_stats/out_stats (S, N) with ``in_mask`` (S, N) saying which shadow holds
    which example (the "in" entries of ``in_stats`` and the "out" entries of ``out_stats`` are
    used; pass the same matrix twice when one shadow matrix holds both)."""
    in_mask = np.asarray(in_mask, dtype=bool)
    out_mask = ~in_mask
    if (in_mask.sum(0) == 0).any() or (out_mask.sum(0) == 0).any():
        raise ValueError("every example needs at least one 'in' and one 'out' shadow model")
    stats_in = np.where(in_mask, in_stats, np.nan)
    stats_out = np.where(out_mask, out_stats, np.nan)
    mu_in, mu_out = np.nanmean(stats_in, 0), np.nanmean(stats_out, 0)
    if fixed_variance:
        var_in = np.full_like(mu_in, max(np.nanvar(stats_in - mu_in), min_var))
        var_out = np.full_like(mu_out, max(np.nanvar(stats_out - mu_out), min_var))
    else:
        var_in = np.maximum(np.nanvar(stats_in, 0), min_var)
        var_out = np.maximum(np.nanvar(stats_out, 0), min_var)
    return _log_normal(target, mu_in, var_in) - _log_normal(target, mu_out, var_out)


def balanced_membership(n_examples: int, n_shadows: int, seed: int = 0) -> np.ndarray:
    """(S, N) boolean: each example is "in" for exactly S/2 shadows (S even), seeded."""
    if n_shadows < 2 or n_shadows % 2:
        raise ValueError(f"n_shadows must be an even number >= 2, got {n_shadows}")
    rng = np.random.default_rng(seed)
    mask = np.zeros((n_shadows, n_examples), dtype=bool)
    for j in range(n_examples):
        mask[rng.permutation(n_shadows)[: n_shadows // 2], j] = True
    return mask


def summarize(scores: np.ndarray) -> dict[str, float]:
    return {
        "member_rate": 100.0 * float((scores > 0).mean()),
        "mean_llr": float(scores.mean()),
        "median_llr": float(np.median(scores)),
    }


ShadowTrainer = Callable[[SampleSet, int], nn.Module]


def shadow_statistics(
    task: Task, forget: SampleSet, retain: SampleSet, train_shadow: ShadowTrainer, *,
    n_shadows: int = 8, seed: int = 0, batch_size: int = 256,
) -> tuple[np.ndarray, np.ndarray]:
    """Train ``n_shadows`` models on D_r + a balanced half of D_f; return (phi (S, N), in_mask)."""
    mask = balanced_membership(len(forget), n_shadows, seed)
    stats = np.zeros((n_shadows, len(forget)))
    y = forget.columns["y"]
    from pipeline.progress import track

    for s in track(range(n_shadows), desc="LiRA shadow models", unit="model"):
        included = forget.take(torch.as_tensor(np.flatnonzero(mask[s])))
        data = SampleSet({k: torch.cat([retain.columns[k], included.columns[k]]) for k in retain.columns},
                         torch.cat([retain.sample_ids, included.sample_ids]))
        shadow = train_shadow(data, seed * 1000 + s)
        stats[s] = logit_confidence(logits_of(shadow, task, forget, batch_size), y)
    return stats, mask


def lira_scores(
    model: nn.Module, task: Task, forget: SampleSet, shadow_stats: np.ndarray, in_mask: np.ndarray, *,
    fixed_variance: bool = True, batch_size: int = 256,
) -> dict[str, object]:
    """Score a (unlearned) target on D_f against precomputed shadow statistics."""
    target = logit_confidence(logits_of(model, task, forget, batch_size), forget.columns["y"])
    scores = gaussian_llr(target, shadow_stats, shadow_stats, in_mask, fixed_variance=fixed_variance)
    return {**summarize(scores), "scores": scores.tolist()}


def ulira_attack_accuracy(unlearned: np.ndarray, retrained: np.ndarray, *, min_var: float = 1e-4,
                          resamples: int = 1000, seed: int = 0) -> dict[str, Any]:
    """U-LiRA distinguishing game (Hayes et al. 2024), leave one shadow pair out.

    ``unlearned`` (S, N): phi of each forget example under S models trained on D (different
    seeds) then unlearned; ``retrained`` (S, N): under S models retrained on D_r. For each held
    out pair s the attacker fits, per example, Gaussians N(mu_u, v_u) and N(mu_r, v_r) on the
    other S - 1 pairs (variances pooled over examples, Carlini et al.'s fixed-variance variant),
    and calls a target "unlearned" when log N(phi; mu_u, v_u) - log N(phi; mu_r, v_r) > 0 (a tie
    counts half). Accuracy over the 2 S N decisions, in percent: 50 = indistinguishable.

    ``ci95``: a 95 % interval of the accuracy by a bootstrap over the forget examples (``resamples``
    draws of N examples with replacement, each example's 2 S decisions kept together; seeded): it holds the
    2 S models fixed (they are shared by all the examples), so it is conditional on them. ``per_pair`` (S, N):
    each held-out pair's accuracy on each example (the mean of its two decisions), from which
    ``pooled_attack_accuracy`` also resamples the pairs."""
    u, r = np.asarray(unlearned, dtype=np.float64), np.asarray(retrained, dtype=np.float64)
    if u.shape != r.shape or u.ndim != 2 or u.shape[0] < 3:
        raise ValueError(f"U-LiRA needs (S, N) statistics with S >= 3 shadow pairs of equal shape, got {u.shape}, {r.shape}")
    s_count = u.shape[0]
    correct = []
    for s in range(s_count):
        keep = np.arange(s_count) != s
        mu_u, mu_r = u[keep].mean(0), r[keep].mean(0)
        var_u = max(float(((u[keep] - mu_u) ** 2).mean()), min_var)
        var_r = max(float(((r[keep] - mu_r) ** 2).mean()), min_var)
        for target, is_unlearned in ((u[s], True), (r[s], False)):
            llr = _log_normal(target, mu_u, np.full_like(mu_u, var_u)) - _log_normal(target, mu_r, np.full_like(mu_r, var_r))
            said = np.where(llr > 0, 1.0, np.where(llr < 0, 0.0, 0.5))
            correct.append(said if is_unlearned else 1.0 - said)
    acc = np.stack(correct)  # (2 S, N): pair s's two decisions in rows 2 s, 2 s + 1
    per_example = acc.mean(0)
    out: dict[str, Any] = {"accuracy": 100.0 * float(acc.mean()), "shadow_pairs": int(s_count),
                           "examples": int(u.shape[1]), "decisions": int(acc.size),
                           "per_pair": acc.reshape(s_count, 2, -1).mean(1).tolist()}
    if resamples > 0:
        rng = np.random.default_rng(seed)
        draws = rng.integers(0, len(per_example), size=(int(resamples), len(per_example)))
        means = 100.0 * per_example[draws].mean(1)
        out["ci95"] = [float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))]
        out["interval"] = f"bootstrap over the {len(per_example)} forget examples ({int(resamples)} resamples)"
    return out


def pooled_attack_accuracy(games: Sequence[Mapping[str, Any]], *, resamples: int = 1000,
                           seed: int = 0) -> dict[str, Any]:
    """One U-LiRA row over several forget sets, each set's game played on its own (``ulira_attack_accuracy``, the
    same S shadow pairs): the accuracy over all their decisions, sum_k N_k acc_k / sum_k N_k, and two 95 % intervals
    (``resamples`` seeded draws each):

    ``ci95``: pairs and examples resampled together: each draw takes S pair indices with replacement, the same for
      every set (pair s holds the original trained with seed s in every set's game: the originals, and so the removals
      started from them, are shared across sets), and N_k examples with replacement from set k; the draw's accuracy
      is the mean over those pairs and examples. It counts the models' variation as well as the examples', and is
      conservative: resampling both ways of a crossed array counts their interaction twice (McCullagh, "Resampling
      and exchangeable arrays", Bernoulli 2000).
    ``ci95_examples``: the examples alone (stratified by set), the models held fixed: each set's own ``ci95`` where
      there is one set.

    Both are conditional on the k sets drawn (k is too few to resample them): ``per_set`` gives each set's accuracy
    and its own interval, their spread the reader's view of how sets differ."""
    if not games:
        raise ValueError("pooling needs at least one game")
    pairs = {int(g["shadow_pairs"]) for g in games}
    if len(pairs) != 1:
        raise ValueError(f"the games were played with different numbers of shadow pairs: {sorted(pairs)}")
    missing = [i for i, g in enumerate(games) if "per_pair" not in g]
    if missing:
        raise ValueError(f"games {missing} hold no per-pair accuracies (written before they were recorded)")
    mats = [np.asarray(g["per_pair"], dtype=np.float64) for g in games]  # (S, N_k) each
    s_count = pairs.pop()
    if any(m.ndim != 2 or m.shape[0] != s_count for m in mats):
        raise ValueError(f"per_pair must be (S, N) with S = {s_count} shadow pairs: {[m.shape for m in mats]}")
    examples = int(sum(m.shape[1] for m in mats))
    out: dict[str, Any] = {"accuracy": 100.0 * float(sum(m.mean(0).sum() for m in mats) / examples),
                           "shadow_pairs": s_count, "examples": examples,
                           "decisions": int(sum(int(g["decisions"]) for g in games)),
                           "per_set": [{"accuracy": float(g["accuracy"]), "ci95": g.get("ci95"),
                                        "examples": int(g["examples"])} for g in games]}
    if resamples > 0:
        r = int(resamples)
        rng = np.random.default_rng(seed)  # the examples alone: per set, the draws ulira_attack_accuracy makes
        total = np.zeros(r)
        for m in mats:
            total += m.mean(0)[rng.integers(0, m.shape[1], size=(r, m.shape[1]))].sum(1)
        out["ci95_examples"] = _percentiles(100.0 * total / examples)
        rng = np.random.default_rng(seed + 1)
        chosen = rng.integers(0, s_count, size=(r, s_count))  # pairs: one draw for all sets
        total = np.zeros(r)
        for m in mats:
            over_pairs = m[chosen].mean(1)  # (r, N_k)
            picks = rng.integers(0, m.shape[1], size=(r, m.shape[1]))
            total += np.take_along_axis(over_pairs, picks, axis=1).sum(1)
        out["ci95"] = _percentiles(100.0 * total / examples)
        if len(games) > 1:  # each set's own interval of the same kind
            for entry, game in zip(out["per_set"], games):
                entry["ci95_pairs_and_examples"] = pooled_attack_accuracy([game], resamples=r, seed=seed)["ci95"]
        out["interval"] = (f"ci95: bootstrap over the {s_count} shadow pairs and the {examples} forget examples of "
                           f"{len(mats)} set(s) together; ci95_examples: over the examples alone, stratified by set, "
                           f"the models held fixed ({r} resamples each; both conditional on the sets drawn)")
    return out


def _percentiles(means: np.ndarray) -> list[float]:
    return [float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))]


def forget_statistics(model: nn.Module, task: Task, forget: SampleSet, batch_size: int = 256,
                      logits: Tensor | None = None) -> np.ndarray:
    """phi (``logit_confidence``) of every forget example under ``model`` (or of given ``logits``)."""
    z = logits if logits is not None else logits_of(model, task, forget, batch_size)
    return logit_confidence(z, forget.columns["y"])


def ulira_game(retrained: Sequence[np.ndarray], rows: Mapping[str, Any], *, resamples: int = 1000,
               seed: int = 0) -> dict[str, Any]:
    """The attack for each row of a U-LiRA cell. ``retrained``: phi on D_f of the S retrained shadow models;
    ``rows``: per row, either the S unlearned shadows' phi (a list of arrays; the untouched originals for the
    'original' row) or a dict saying why the row has no game (a refusal or an error on a shadow request),
    passed through as it is."""
    r = np.stack([np.asarray(p, dtype=np.float64) for p in retrained])
    out: dict[str, Any] = {}
    for name, phis in rows.items():
        if isinstance(phis, dict):
            out[name] = dict(phis)
            continue
        out[name] = ulira_attack_accuracy(np.stack(phis), r, resamples=resamples, seed=seed)
    return out


ATTACKABLE = 60.0  # the untouched original must score at least this for a U-LiRA reading of its removals to count


def phi_parts(logits: Tensor, y: Tensor) -> dict[str, np.ndarray]:
    """phi on each forget example and its two parts (``logit_parts``): {"phi", "label", "others"}."""
    split = logit_parts(logits, y)
    return {"phi": split["label"] - split["others"], **split}


def play_ulira(retrained: Sequence[Mapping[str, np.ndarray]], rows: Mapping[str, Any], *, resamples: int = 1000,
               seed: int = 0) -> dict[str, Any]:
    """One U-LiRA cell: the game of every row (``ulira_game``) and what it reads by (``statistic_shift`` of phi
    and of its two parts), and whether the cell can be read at all.

    ``retrained``: per shadow pair s, ``phi_parts`` of the model retrained on D_r with seed s; ``rows``: per row,
    the ``phi_parts`` of its S unlearned shadows (pair s: the original trained on D with seed s, then unlearned;
    the untouched originals for the row named "original", which must be present) or a dict saying why the row has
    no game. ``attackable``: the original scores at least ``ATTACKABLE``; below it the attack cannot tell doing
    nothing from Retrain, and every row reads near 50 whatever it did."""
    if "original" not in rows or isinstance(rows["original"], dict):
        raise ValueError("a U-LiRA cell needs the untouched originals' row, 'original'")
    game = ulira_game([p["phi"] for p in retrained],
                      {name: v if isinstance(v, dict) else [p["phi"] for p in v] for name, v in rows.items()},
                      resamples=resamples, seed=seed)
    for name, v in rows.items():
        if not isinstance(v, dict):
            game[name]["reads"] = {part: statistic_shift(np.stack([p[part] for p in v]),
                                                         np.stack([p[part] for p in retrained]))
                                   for part in ("phi", "label", "others")}
    original = float(game["original"]["accuracy"])
    readable = original >= ATTACKABLE
    return {"shadows": len(retrained), "rows": game, "attackable": bool(readable),
            "note": (f"the original row scores {original:.1f} (>= {ATTACKABLE:g}): the cell can be read" if readable
                     else f"the original row scores {original:.1f} (< {ATTACKABLE:g}): the attack cannot tell doing "
                          "nothing from Retrain here; no U-LiRA floor is read in this cell")}


def control_games(retrained: Sequence[Mapping[str, Any]], rows: Mapping[str, Any], *, resamples: int = 1000,
                  seed: int = 0) -> dict[str, Any]:
    """The U-LiRA game of every row played again on control sets, samples the removal was not asked about (members
    of D_r, test samples): ``retrained`` and ``rows`` as for ``play_ulira``, each entry's ``"controls"`` holding phi
    on each control set by name. A removal that differs from Retrain on every sample reads above 50 there too, so the
    forget set's reading above its controls' is what the removal left of D_f; an exact Retrain reads 50 on every
    set. Per set: the attack's accuracy and 95 % interval of each row (``ulira_attack_accuracy``, the per-pair
    decisions left out), or the row's dict saying why it has no game."""
    names = sorted(retrained[0].get("controls", {})) if retrained else []
    out: dict[str, Any] = {}
    for key in names:
        game = ulira_game([p["controls"][key] for p in retrained],
                          {name: v if isinstance(v, dict) else [p["controls"][key] for p in v] for name, v in rows.items()},
                          resamples=resamples, seed=seed)
        out[key] = {name: (dict(g) if "accuracy" not in g else
                           {k: g[k] for k in ("accuracy", "ci95", "examples", "decisions") if k in g})
                    for name, g in game.items()}
    return out


def pool_ulira(cells: Sequence[Mapping[str, Any]], labels: Sequence[Any], what: str = "forget set") -> dict[str, Any]:
    """Several U-LiRA cells of one model (``play_ulira``'s, each on its own forget set, the same shadow pairs) pooled
    per row (``pooled_attack_accuracy``). A row with no game on some cell (refused or failed on a pair, or absent) is
    not pooled and says on which (``labels``: how each cell is named, ``what`` the kind of name). The pool is read
    (``attackable``) only where the original scores at least ``ATTACKABLE`` on every cell: on a cell where the attack
    cannot tell doing nothing from Retrain every row reads near 50, whatever it did, and would pull the pool to 50."""
    if len(cells) != len(labels) or not cells:
        raise ValueError("pooling needs at least one cell, and one label per cell")
    names: list[str] = []
    for cell in cells:
        names += [name for name in cell["rows"] if name not in names]
    rows: dict[str, Any] = {}
    for name in names:
        played = [cell["rows"].get(name) for cell in cells]
        unplayed = next(((label, r) for label, r in zip(labels, played)
                         if not isinstance(r, dict) or "accuracy" not in r), None)
        if unplayed is not None:
            rows[name] = {"not_pooled": f"no game on {what} {unplayed[0]}",
                          **(unplayed[1] if isinstance(unplayed[1], dict) else {})}
            continue
        rows[name] = pooled_attack_accuracy(played)
    originals = [float(cell["rows"]["original"]["accuracy"]) for cell in cells]
    weak = [label for label, a in zip(labels, originals) if a < ATTACKABLE]
    shown = ", ".join(f"{a:.1f}" for a in originals)
    return {"rows": rows, "attackable": not weak,
            "note": (f"the original row scores {shown} on its sets (each >= {ATTACKABLE:g}): the cell can be read"
                     if not weak else
                     f"the original row scores {shown} on its sets, under {ATTACKABLE:g} on set(s) "
                     f"{', '.join(str(k) for k in weak)}: no U-LiRA floor is read on the pool")}
