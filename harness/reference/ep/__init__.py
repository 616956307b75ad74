"""MinimalAsyncEP-style expert-parallel token exchange: ops, per-rank exchange state, logical groups."""
