"""The delta rule and the gated delta product (DeltaNet, Gated DeltaNet, DeltaProduct, KDA): the float64 oracle, the
chunked PyTorch form, the Triton forward and the dispatcher."""
