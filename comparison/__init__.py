"""Topology comparisons as a library: the reports of finished runs (:mod:`~comparison.report`) and the paper's
diagnostics of a finished DeiT or DiT run (:mod:`~comparison.diagnose`). ``python -m scripts.compare`` trains the
runs; ``python -m scripts.diagnose`` diagnoses runs by hand."""
