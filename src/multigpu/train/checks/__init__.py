"""Checks of a run's setup before and while it trains."""
