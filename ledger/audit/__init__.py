"""The audit chain: writing it, verifying it, and signed heads exported outside the database."""
