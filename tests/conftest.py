"""Test-session settings: one BLAS thread (scipy's sqrtm spins on a busy 2-core machine otherwise)."""
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
