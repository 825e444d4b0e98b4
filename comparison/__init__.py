"""Topology comparisons as a library: one run trained, evaluated and diagnosed (:mod:`~comparison.runs`), the reports
of finished runs (:mod:`~comparison.report`) and the paper's diagnostics of a finished DeiT or DiT run
(:mod:`~comparison.diagnose`). ``python -m scripts.compare`` runs a comparison; ``python -m scripts.diagnose``
diagnoses runs by hand."""
