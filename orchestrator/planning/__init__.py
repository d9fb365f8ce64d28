"""Per-request planning: the controls (fixed, dynamic gamma, cost-aware), the cost model V(n) / D(p) and tree shaping. Imports only specdec."""
