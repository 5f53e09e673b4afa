"""Billing and finance: the price book, cost of usage in integer micro-USD, cost attribution of engine time,
daily roll-ups, monthly statements and finance exports (docs/billing.md)."""
