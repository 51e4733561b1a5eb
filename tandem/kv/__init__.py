from tandem.kv.block_pool import BlockPool, OutOfBlocks
from tandem.kv.block_table import BlockTable
from tandem.kv.cache import KVCache

__all__ = ["BlockPool", "BlockTable", "KVCache", "OutOfBlocks"]
