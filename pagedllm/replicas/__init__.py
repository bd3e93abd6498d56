"""Data-parallel serving: engine replicas (on Ray) behind one endpoint and a prefix-aware router."""
