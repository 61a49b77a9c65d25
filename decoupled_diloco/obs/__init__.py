"""Observability: metrics files, TensorBoard, timelines and goodput, plots, reports, live status."""
