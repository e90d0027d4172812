"""The best linear read-out of a frozen policy's hidden state: a ridge regression and its penalty.

study/pretrain_critic.py's "linear" row, the ceiling of a value head (a head reads the same hidden state): a ridge
from each measured state's hidden state to its Monte Carlo mean, its penalty chosen by generalised cross-validation
(Golub, Heath and Wahba 1979, https://doi.org/10.1080/00401706.1979.10489751) on the fit's own states. Pure
functions on tensors; does not hold the states, the folds or the measurement (study/pretrain_critic.py, measure.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch

PENALTIES = tuple(10.0**k for k in range(-5, 5))  # ridge penalties tried, on standardised features, per state


def ridge(x: torch.Tensor, y: torch.Tensor, penalty: float) -> Any:
    """A ridge regression of y [n] on x [n, H], the features standardised by x's own mean and spread and the target
    centred (the intercept unpenalised), the penalty per state (penalty x n on the diagonal). -> predict(x') [n']"""
    mean, scale = x.mean(0), x.std(0, unbiased=False).clamp_min(1e-8)
    z = (x - mean) / scale
    eye = torch.eye(x.shape[1], dtype=x.dtype)
    w = torch.linalg.solve(z.T @ z + penalty * len(x) * eye, z.T @ (y - y.mean()))
    return lambda xs: ((xs - mean) / scale) @ w + y.mean()


def choose_penalty(x: torch.Tensor, y: torch.Tensor) -> float:
    """The penalty of PENALTIES with the least generalised cross-validation error on the fit's own states (Golub,
    Heath and Wahba 1979: n |y - H y|^2 / (n - tr H - 1)^2, H the ridge's hat matrix, the intercept's degree of
    freedom counted): the leave-one-out error in closed form, every state of the fit used, none outside it."""
    z = (x - x.mean(0)) / x.std(0, unbiased=False).clamp_min(1e-8)
    yc = y - y.mean()
    u, s, _ = torch.linalg.svd(z, full_matrices=False)
    uy, n = u.T @ yc, len(x)
    best, chosen = math.inf, PENALTIES[-1]
    for penalty in PENALTIES:
        shrink = s**2 / (s**2 + penalty * n)
        free = n - shrink.sum().item() - 1  # the residual's degrees of freedom
        if free < 1:
            continue
        gcv = n * ((yc - u @ (shrink * uy)) ** 2).sum().item() / free**2
        if gcv < best:
            best, chosen = gcv, penalty
    return chosen
