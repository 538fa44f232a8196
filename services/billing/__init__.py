"""Loopline billing service: admission layers, reservations, ledger, token metering (see README.md)."""
