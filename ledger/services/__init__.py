"""Writes. Every state change in the ledger goes through a function in this package."""
