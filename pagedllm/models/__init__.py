"""The models' math, one module per architecture (registry.py says which), and loading their weights."""
