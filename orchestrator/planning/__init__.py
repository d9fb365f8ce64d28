"""Per-request planning: the controls (fixed, cost-aware), the cost model V(n) / D(p), tree shaping and the lock-step
round clock. Imports only specdec."""
