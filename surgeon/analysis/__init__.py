"""`surgeon analyze`: per-layer measures on calibration text, their plots, an HTML report and a
suggested recipe. measures.py computes, surgeon/report/figures.py draws, suggest.py decides, html_report.py writes
the page, analyze.py ties them together."""

from .analyze import Report, analyze

__all__ = ["Report", "analyze"]
