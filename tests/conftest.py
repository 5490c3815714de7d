"""Shared test set-up.

NumPy's multithreaded BLAS makes the small float64 matrix products of the reference models 3-20x
slower on 2 shared cores, so tests pin it to one thread (before NumPy loads its BLAS).
"""
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
