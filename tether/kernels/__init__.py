"""Paged attention and the KV cache it reads: below both `models/` (whose forward calls them) and
`engine/` (which allocates the cache and plans the blocks)."""
