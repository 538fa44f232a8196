"""Loopline billing service: admission, reservations, ledger, token metering (README.md)."""
