"""Integrations with inference engines and trainers. Each lives in its own package and imports its
engine lazily: ``import weightsync`` never needs them installed."""
