"""Decoding: one validated Request (request.py), the pure token pick (sampling.py), the drafters
(drafters.py: prompt lookup, the n-gram pool, a draft model; head.py: a head on the target's hidden
states; mix.py: a lookup beside either, chosen per step), the draft length by cost (cost.py), prompt chunking (chunking.py) and the loop that drafts, verifies in one forward and
accepts (loop.py: Batch, run_batch)."""
