"""Adapters that run real inference engines on kvd (optional extra `engines`).

Each adapter lives in its own module and imports its engine lazily, so `import kvd` never needs
torch: `from kvd.integrations.transformers import KvdCache` is where transformers is required.
"""
