"""Model building blocks, one per file; attention takes an explicit metadata object (no global context)."""
