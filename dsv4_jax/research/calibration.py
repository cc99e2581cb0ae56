"""Calibration of a drafter's confidence head against realised acceptance (docs/verification.md §4).

Evidence comes as per-position bins (what the speculative loop records, `ops.verification.calibration_counts`:
count, accepted, Σ confidence per confidence bin, plus Σ (c − y)² per position) or as raw samples
(`bins_from_samples`). Per position j:

    ECE_j   = Σ_b (n_b / N) · |acc_b − conf_b|      (acc_b, conf_b: the bin's accepted fraction, mean confidence)
    Brier_j = (1/N) Σ (c − y)²
    AUROC_j = P(c of an accepted draft > c of a rejected one) (+ ½ ties); from bins, drafts of one bin tie,
              so the binned value is the exact AUROC of the confidence rounded to its bin.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


def bins_from_samples(conf: np.ndarray, accepted: np.ndarray, n_bins: int = 20):
    """Samples of one position, conf [N] in [0,1] and accepted [N] bool -> (bins [n_bins,3], brier_sum)."""
    conf, y = np.clip(np.asarray(conf, np.float64), 0, 1), np.asarray(accepted, np.float64)
    b = np.clip((conf * n_bins).astype(int), 0, n_bins - 1)
    bins = np.zeros((n_bins, 3))
    np.add.at(bins, b, np.stack([np.ones_like(conf), y, conf], axis=1))
    return bins, float(np.sum((conf - y) ** 2))


def auroc(conf: np.ndarray, accepted: np.ndarray) -> float:
    """Exact AUROC of scores conf [N] for labels accepted [N] (Mann–Whitney, ties ½); nan if one class is absent."""
    conf, y = np.asarray(conf, np.float64), np.asarray(accepted, bool)
    pos, neg = conf[y], conf[~y]
    if len(pos) == 0 or len(neg) == 0:
        return float("nan")
    order = np.sort(neg)
    below = np.searchsorted(order, pos, side="left")
    ties = np.searchsorted(order, pos, side="right") - below
    return float((below + 0.5 * ties).sum() / (len(pos) * len(neg)))


def position_metrics(bins: np.ndarray, brier_sum: float) -> dict:
    """One position's metrics from bins [n_bins,3] (count, accepted, Σ conf)."""
    bins = np.asarray(bins, np.float64)
    n, acc, csum = bins[:, 0], bins[:, 1], bins[:, 2]
    N = n.sum()
    if N == 0:
        return {"n": 0, "accept_rate": None, "mean_confidence": None, "ece": None, "brier": None, "auroc": None}
    nz = n > 0
    ece = float(np.sum(np.abs(acc[nz] - csum[nz])) / N)         # Σ_b n_b |acc_b/n_b − conf_b/n_b| / N
    neg = n - acc
    P, Q = acc.sum(), neg.sum()
    below = np.concatenate([[0.0], np.cumsum(neg)[:-1]])        # rejected drafts in lower bins
    roc = float(np.sum(acc * (below + 0.5 * neg)) / (P * Q)) if P > 0 and Q > 0 else None
    return {"n": int(N), "accept_rate": float(acc.sum() / N), "mean_confidence": float(csum.sum() / N),
            "ece": ece, "brier": float(brier_sum / N), "auroc": roc}


def metrics(calibration: dict) -> list[dict]:
    """A run's `calibration` statistics ({"bins": [K][n_bins][3], "brier_sum": [K]}) -> per position metrics."""
    return [{"position": j + 1, **position_metrics(b, s)}
            for j, (b, s) in enumerate(zip(calibration["bins"], calibration["brier_sum"]))]


def merge(calibrations: Sequence[dict]) -> dict | None:
    """Sum several runs' calibration statistics (same k and bins); None when there are none."""
    cs = [c for c in calibrations if c]
    if not cs:
        return None
    k = max(len(c["brier_sum"]) for c in cs)
    nb = len(cs[0]["bins"][0])
    bins, brier = np.zeros((k, nb, 3)), np.zeros(k)
    for c in cs:
        b = np.asarray(c["bins"], np.float64)
        bins[:b.shape[0]] += b
        brier[:b.shape[0]] += np.asarray(c["brier_sum"], np.float64)
    return {"bins": bins.tolist(), "brier_sum": brier.tolist()}


def reliability_points(bins: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mean confidence, accepted fraction, count) of the non-empty bins of one position."""
    bins = np.asarray(bins, np.float64)
    nz = bins[:, 0] > 0
    return bins[nz, 2] / bins[nz, 0], bins[nz, 1] / bins[nz, 0], bins[nz, 0]


def markdown(rows: list[dict], title: str = "") -> str:
    """Per-position table: n, realised acceptance, mean confidence, ECE, Brier, AUROC."""
    f = lambda v, fmt="{:.3f}": "–" if v is None or (isinstance(v, float) and np.isnan(v)) else fmt.format(v)
    out = [f"{title}\n" if title else "",
           "| position | drafts scored | realised acceptance | mean confidence | ECE | Brier | AUROC |",
           "|---|---|---|---|---|---|---|"]
    out += [f"| {r['position']} | {r['n']} | {f(r['accept_rate'])} | {f(r['mean_confidence'])} | {f(r['ece'])} | "
            f"{f(r['brier'])} | {f(r['auroc'])} |" for r in rows]
    return "\n".join(x for x in out if x != "") + "\n"
