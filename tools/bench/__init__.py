"""Benchmarks: scripts that print tables (speed and size targets live here, not in timed tests).
"""
