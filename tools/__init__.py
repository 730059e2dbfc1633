"""Build tools of the Kimi-K3 SM120 serving stack: one module per pipeline stage."""
