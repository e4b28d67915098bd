"""Test and benchmark support: builders of the tiny models, rank helpers (not the product)."""
