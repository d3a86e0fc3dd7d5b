"""Decoding: one validated Request (request.py), the pure token pick (sampling.py), the drafters
(drafters.py: prompt lookup, a draft model) and the loop that drafts, verifies in one forward and
accepts (loop.py: Batch, run_batch)."""
