"""The memory and scheduling core, pure Python (no torch): physical blocks, which request
holds which, who runs each step, requests and their outputs."""
