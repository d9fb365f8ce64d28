"""Per-request planning: the controls (fixed, cost-aware), the cost model V(n) / D(p) and tree shaping. Imports only
specdec."""
