"""Faults as first-class inputs: seeded schedules, live controls, and the injector."""
