"""Chaos: the ten guarantees under faults, load and kills, against real processes (`make chaos`)."""
