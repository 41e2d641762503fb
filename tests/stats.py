"""The chi-square test the statistical exactness tests share (verifier, head, model drafter)."""

from __future__ import annotations

import numpy as np
from scipy.stats import chisquare


def p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """Goodness of fit of observed ``counts`` to the distribution ``probs``: the cells expected
    fewer than 5 times are pooled into one (dropped when it is expected never)."""
    expected = probs * counts.sum()
    keep = expected >= 5
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)
