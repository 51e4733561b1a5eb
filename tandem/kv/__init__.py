"""KV cache: the pool tensor (cache.py), its blocks (block_pool.py, block_table.py), block names
(names.py), prefix sharing (prefix_cache.py), leases (lease.py) and the transports between
workers (transports/).

Import the modules themselves: this package loads nothing, so that a process that only needs
block names (the gateway's prefix index) does not load torch."""
