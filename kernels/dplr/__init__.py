"""The generalised delta rule (diagonal-plus-rank-one transitions, RWKV-7): oracle, chunked form, fla bridge and
dispatcher."""
