"""The models' math, one module per architecture, and loading their weights."""
