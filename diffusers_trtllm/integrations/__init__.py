"""Integrations with serving frameworks; each module is imported only by the framework that loads it."""
