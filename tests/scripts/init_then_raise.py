"""A disttrain script whose rank 1 raises after joining the group."""

import disttrain

ctx = disttrain.init()
if ctx.rank == 1:
    raise ValueError("bad shard 17")
disttrain.shutdown()
