"""Fitting a cost model's parameters to measured step times (what ``framework.profile`` runs).

A row predicts ``t = offset + sum_g max_{(i, x) in g} theta_i * x`` (``Groups``: each group one part of the
step, each leg ``(i, x)`` one parameter's term). With each group's binding leg fixed, ``t`` is linear in
``theta``: the fit alternates choosing the binding legs and a bounded least-squares solve on relative error.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

Groups = Sequence[Sequence[tuple[int, float]]]


def predict(offset: float, groups: Groups, theta: Sequence[float]) -> float:
    return offset + sum(max(theta[i] * x for i, x in group) for group in groups)


def fit_max_linear(rows: Sequence[tuple[float, Groups]], measured: Sequence[float], theta0: Sequence[float],
                   lower: Sequence[float], max_iter: int = 50) -> list[float]:
    """``theta >= lower`` minimising the squared relative error of ``predict`` over the rows.

    A parameter whose legs bind in no row cannot be identified and keeps its ``theta0`` value.
    Returns the best ``theta`` seen (the alternation can cycle between leg choices).
    """
    y = np.asarray(measured, dtype=float)
    if (y <= 0).any():
        raise ValueError("measured step times must be > 0 seconds")
    n = len(theta0)
    theta = np.maximum(np.asarray(theta0, dtype=float), lower)
    lb = np.asarray(lower, dtype=float)
    best, best_err, seen = theta.copy(), np.inf, set()
    w = 1.0 / y  # relative error: each row weighted by its measured time
    for _ in range(max_iter):
        A = np.zeros((len(rows), n))
        offsets = np.empty(len(rows))
        choice = []
        for r, (offset, groups) in enumerate(rows):
            offsets[r] = offset
            for group in groups:
                i, x = max(group, key=lambda leg: theta[leg[0]] * leg[1])
                A[r, i] += x
                choice.append(i)
        key = tuple(choice)
        if key in seen:
            break
        seen.add(key)
        used = np.flatnonzero(np.abs(A).sum(axis=0) > 0)
        # theta = lb + phi with phi >= 0; unused parameters (no binding leg) keep their value.
        target = (y - offsets - A[:, used] @ lb[used]) * w
        M = A[:, used] * w[:, None]
        phi = nnls(M, target)
        theta = theta.copy()
        theta[used] = lb[used] + phi
        pred = np.array([predict(o, g, theta) for o, g in rows])
        err = float(np.sum(((pred - y) / y) ** 2))
        if err < best_err:
            best, best_err = theta.copy(), err
    return [float(t) for t in best]


def nnls(A: np.ndarray, b: np.ndarray, tol: float = 1e-12) -> np.ndarray:
    """``argmin ||A x - b||`` subject to ``x >= 0`` (Lawson and Hanson's active-set method).
    Columns are scaled to unit norm first so parameters of very different units are treated alike."""
    scale = np.linalg.norm(A, axis=0)
    scale[scale == 0] = 1.0
    A = A / scale
    m, n = A.shape
    passive = np.zeros(n, dtype=bool)
    x = np.zeros(n)
    w = A.T @ (b - A @ x)
    for _ in range(3 * n + 10):
        candidates = np.where(passive, -np.inf, w)
        if passive.all() or candidates.max() <= tol:
            break
        passive[int(np.argmax(candidates))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(A[:, passive], b, rcond=None)[0]
            if (z[passive] > tol).all():
                break
            blocking = passive & (z <= tol)
            d = x[blocking] - z[blocking]
            alpha = float(np.min(np.where(d > 0, x[blocking] / np.where(d > 0, d, 1.0), 0.0)))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
        x = z
        w = A.T @ (b - A @ x)
    return x / scale
