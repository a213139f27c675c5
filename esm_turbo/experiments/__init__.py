"""Experiment sweeps: structured configs (``config``), the KV-compression method zoo (``methods``), one
run → one result row (``runner``), and the tables and plots made from the rows (``report``)."""
