"""What communication and memory cost: the alpha-beta model and the ZeRO memory formulas.

A message of S bytes between two ranks takes alpha + S * beta seconds: alpha is the latency
(start-up) per message, beta the seconds per byte (1 / bandwidth). The ring algorithms
(docs/papers.md, "Collectives and their cost") on N ranks cost:
    all-reduce:                     2(N-1) alpha + 2(N-1)/N * S * beta
    all-gather, reduce-scatter:      (N-1) alpha +  (N-1)/N * S * beta
where S is the full size (all-reduce: the buffer; all-gather: the gathered output).
ZeRO (Rajbhandari et al. 2020, section 5) counts model-state bytes per parameter.
"""
from __future__ import annotations


def ring_all_reduce_time(nbytes: float, world_size: int, alpha: float, beta: float) -> float:
    """Seconds for a ring all-reduce of ``nbytes`` over ``world_size`` ranks (0 for one rank).

    ``2(N-1) * alpha + 2(N-1)/N * nbytes * beta``. Check: the bandwidth term tends to
    ``2 * nbytes * beta`` as N grows, and is twice the all-gather's.
    """
    raise NotImplementedError("exercise: costs.ring_all_reduce_time (see the docstring)")


def ring_all_gather_time(nbytes: float, world_size: int, alpha: float, beta: float) -> float:
    """Seconds for a ring all-gather (or reduce-scatter) whose full output is ``nbytes``.

    ``(N-1) * alpha + (N-1)/N * nbytes * beta``. Check: a reduce-scatter followed by an
    all-gather costs exactly one all-reduce.
    """
    raise NotImplementedError("exercise: costs.ring_all_gather_time (see the docstring)")


def fit_alpha_beta(sizes: list[float], times: list[float]) -> tuple[float, float]:
    """Fit ``time = alpha + beta * size`` by least *relative* error; returns ``(alpha, beta)``.

    Sizes usually span several powers of two; a plain least-squares line would fit the largest
    messages and ignore the latency of the small ones. So minimise the sum of
    ``((alpha + beta * s - t) / t) ** 2``: weighted least squares with weights ``w = 1 / t**2``,
    beta = sum w (s - ms)(t - mt) / sum w (s - ms)**2 and alpha = mt - beta * ms, where ms and mt
    are the w-weighted means. Plain Python, no numpy. Needs at least two different sizes and
    positive times (else ``ValueError``).
    Check: recovers alpha and beta from times made with them, also with a little noise.
    """
    raise NotImplementedError("exercise: costs.fit_alpha_beta (see the docstring)")


def zero_model_state_bytes(num_params: float, world_size: int, stage: int, param_bytes: int = 2,
                           grad_bytes: int = 2, optimizer_bytes: int = 12) -> float:
    """Model-state bytes per rank for ZeRO ``stage`` 0 (plain DDP), 1, 2 or 3.

    With P = param_bytes, G = grad_bytes, K = optimizer_bytes per parameter, Psi parameters and
    N ranks: stage 0 (P+G+K)Psi; stage 1 PPsi + GPsi + KPsi/N; stage 2 PPsi + (G+K)Psi/N;
    stage 3 (P+G+K)Psi/N. The defaults are the paper's mixed-precision Adam (2, 2, 12); fp32
    Adam on a CPU is (4, 4, 8). Any other stage is a ``ValueError``.
    Check: the paper's example, 7.5e9 parameters on 64 ranks: 120, 31.4, 16.6, 1.9 GB.
    """
    raise NotImplementedError("exercise: costs.zero_model_state_bytes (see the docstring)")
