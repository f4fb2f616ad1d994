"""Tolerances of the exactness tests, by dtype."""

# "exact" cached-vs-uncached agreement in fp32 (kernel reduction order differs)
ATOL_FP32 = 1e-4
