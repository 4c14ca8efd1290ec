"""Fit the polynomial behind the INT8 GEMM's GELU (cuda_kernels/qgemm_sm90.cu, ``kiln_gelu``) and print its error.

    python -m tools.fit_gelu [--degree 9] [--limit 5.5]

GELU(x) = x Phi(x) with Phi(-t) = erfc(t / sqrt 2) / 2. The kernel evaluates ``log2 Phi(-t)`` for t = min(|x|, limit)
as one polynomial -1 + t (c1 + t (c2 + ...)) (fp32 FMAs), raises 2 to it (one ``ex2.approx``) and takes 1 - h for
x >= 0, h for -limit < x < 0, 0 below: ~17 instructions where erff spends ~30 (two coefficient sets chosen by a
select per term), which made the FFN1 epilogue issue-bound. The constant term is pinned to -1, so Phi(0) = 1/2.
The fit is least squares on Chebyshev nodes, reweighted towards the largest errors (a near-minimax fit). The
printed table compares the fp32 evaluation (FMAs emulated in float64, 2^p exact) with the fp32 ``x/2 (1 +
erf(x / sqrt 2))`` that the CPU op computes, both against exact GELU: the same few 1e-7 of absolute error.
``engine_core.backends.cuda.qgemm.GELU_LOG2_PHI`` holds the coefficients (a CPU test checks the kernel's copy).

``--form sigmoid`` fits the cheaper form the kernels use where the result is requantized to int8 (``kiln_gelu_q``):
GELU(x) ~ x / (1 + 2^(x q(t))), t = min(x^2, t_max), q a polynomial in t (degree 2: ~2.5e-5 absolute error, under
1% of an int8 step at the scales it is used for; ``qgemm.GELU_SIGMOID``): 7 instructions, ``ex2.approx`` and
``rcp.approx``, where the log2 Phi form takes ~17 on an epilogue that is issue-bound.
"""

from __future__ import annotations

import argparse
import math

import numpy as np

_erfc, _erf = np.vectorize(math.erfc), np.vectorize(math.erf)


def log2_phi_neg(t: np.ndarray) -> np.ndarray:
    """log2 Phi(-t), the fitted function."""
    return np.log2(0.5 * _erfc(t / math.sqrt(2.0)))


def fit(degree: int, limit: float, rounds: int = 60) -> np.ndarray:
    """Coefficients c1 .. c_degree (ascending) of log2 Phi(-t) + 1 = t (c1 + c2 t + ...) on [0, limit], float32."""
    t = (np.cos(np.linspace(0.0, math.pi, 4000)) + 1.0) * limit / 2.0
    t = t[t > 0]
    target, weight = (log2_phi_neg(t) + 1.0) / t, np.ones_like(t)
    for _ in range(rounds):
        coeffs = np.polynomial.polynomial.polyfit(t, target, degree - 1, w=weight)
        err = np.abs(np.polynomial.polynomial.polyval(t, coeffs) - target) * t
        weight *= 1.0 + 2.0 * err / err.max()
        weight /= weight.mean()
    return coeffs.astype(np.float32)


def gelu_fp32(x: np.ndarray, coeffs: np.ndarray, limit: float) -> np.ndarray:
    """The kernel's evaluation in float32 (each FMA rounded once), as ``kiln_gelu`` does it."""
    x = x.astype(np.float32)
    t = np.minimum(np.abs(x), np.float32(limit)).astype(np.float64)
    p = np.full(x.shape, coeffs[-1], np.float32)
    for c in coeffs[-2::-1]:
        p = (p.astype(np.float64) * t + np.float64(c)).astype(np.float32)
    p = (p.astype(np.float64) * t - 1.0).astype(np.float32)
    h = np.exp2(p.astype(np.float64)).astype(np.float32)
    phi = np.where(x >= 0, np.float32(1.0) - h, np.where(np.abs(x) < np.float32(limit), h, np.float32(0.0)))
    return (x * phi).astype(np.float32)


def fit_sigmoid(degree: int, t_max: float, rounds: int = 200) -> np.ndarray:
    """Coefficients k0 .. k_degree (ascending, float32) of q(t), t = min(x^2, t_max), such that x / (1 + 2^(x q(t)))
    is GELU: least squares of x q(x^2) = log2((1 - Phi(x)) / Phi(x)) for 0 < |x| < sqrt(t_max), reweighted towards
    the largest GELU errors."""
    x = np.linspace(1e-3, math.sqrt(t_max), 6000)
    phi = 0.5 * _erfc(-x / math.sqrt(2.0))
    target, weight = np.log2((1.0 - phi) / phi) / x, np.ones_like(x)
    exact = x * phi
    best = (np.inf, None)
    for _ in range(rounds):
        coeffs = np.polynomial.polynomial.polyfit(x * x, target, degree, w=weight)
        err = np.abs(x / (1.0 + np.exp2(x * np.polynomial.polynomial.polyval(x * x, coeffs))) - exact)
        best = min(best, (float(err.max()), tuple(coeffs)))
        weight *= 1.0 + 2.0 * err / err.max()
        weight /= weight.mean()
    return np.array(best[1], np.float32)


def gelu_sigmoid_fp32(x: np.ndarray, coeffs: np.ndarray, t_max: float) -> np.ndarray:
    """The int8-output kernels' GELU in float32, as ``kiln_gelu_q`` evaluates it (each operation rounded once; 2^z and
    the reciprocal exact, where the GPU's approximations are within 2 ulp)."""
    x = x.astype(np.float32)
    t = np.minimum(x * x, np.float32(t_max)).astype(np.float64)
    q = np.full(x.shape, coeffs[-1], np.float32)
    for c in coeffs[-2::-1]:
        q = (q.astype(np.float64) * t + np.float64(c)).astype(np.float32)
    with np.errstate(over="ignore"):
        e = np.exp2((x * q).astype(np.float64)).astype(np.float32)
        r = (1.0 / (np.float32(1.0) + e).astype(np.float64)).astype(np.float32)
    return (x * r).astype(np.float32)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--degree", type=int, help="log2phi: of log2 Phi(-t) (default 9); sigmoid: of q(t) (2)")
    parser.add_argument("--limit", type=float, help="log2phi: the |x| clamp (5.5); sigmoid: the x^2 clamp (36)")
    parser.add_argument("--form", choices=("log2phi", "sigmoid"), default="log2phi")
    args = parser.parse_args(argv)
    x = np.linspace(-9.0, 9.0, 2_000_001).astype(np.float32)
    if args.form == "sigmoid":
        limit = args.limit or 36.0
        coeffs = fit_sigmoid(args.degree or 2, limit)
        print(f"k0 .. k{len(coeffs) - 1}:", ", ".join(f"{float(c)!r}f" for c in coeffs))
        kernel = gelu_sigmoid_fp32(x, coeffs, limit).astype(np.float64)
    else:
        limit = args.limit or 5.5
        coeffs = fit(args.degree or 9, limit)
        print(f"c1 .. c{len(coeffs)}:", ", ".join(f"{float(c)!r}f" for c in coeffs))
        kernel = gelu_fp32(x, coeffs, limit).astype(np.float64)
    xd = x.astype(np.float64)
    exact = xd * 0.5 * _erfc(-xd / math.sqrt(2.0))
    e32 = _erf((x * np.float32(1 / math.sqrt(2.0))).astype(np.float64)).astype(np.float32)
    cpu = (np.float32(0.5) * x * (np.float32(1.0) + e32)).astype(np.float64)
    print(f"{'x range':<12} {'kernel abs err':>15} {'fp32 erf form':>15}")
    for lo, hi in ((-9, -3), (-3, -1), (-1, 1), (1, 3), (3, 9)):
        m = (x >= lo) & (x < hi)
        print(f"[{lo}, {hi}){'':<5} {np.abs(kernel - exact)[m].max():>15.2e} {np.abs(cpu - exact)[m].max():>15.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
