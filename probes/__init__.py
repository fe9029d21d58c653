"""Analyses over a deltalab store (and a model, for interventions); each is also a script.

Every probe is a library function `probes.NAME.run(ds, ...) -> ProbeResult` (an xarray.Dataset
of results plus JSON records) and a command: `deltalab probe NAME --store STORE [--json]`,
or equivalently `python -m deltalab.probes.NAME`. This module stays import-light (no numpy/torch).
"""

PROBES: dict[str, str] = {
    "betas": "Beta distributions per layer/head/step, per input token; negative-eigenvalue and reflection heads.",
    "keys": "PCA of keys per layer/head/step and over all steps; 3-D coordinates; principal angles.",
    "spectra": "Eigenvalues of each token's Householder product P_t and transition A_t; rotation angles; windows.",
    "erank": "Entropy effective rank, stable rank and rank utilisation of the state per token/head/layer.",
    "linear": "Logistic-regression probes from the recurrence read-out (or a stored variable) to the labels.",
    "lengthgen": "Accuracy and loss against position, within and beyond the training length.",
    "decays": "Forget-gate decays per layer/head/key channel: memory lengths 1/(1-exp g), long-memory channels.",
    "attention": "Exact attention maps (top-k sources per token, signed weights) and the GLA approximation's error.",
    "intervene": "nnsight interventions (set a beta, ablate a head, project keys, erase/write an association, "
                 "scale a decay); change in accuracy, loss and KL.",
    "lens": "Logit lens: the residual after every layer through the final norm and unembedding; top tokens, "
            "the target's probability and rank per layer (a store's resid_post, or --text/--tokens).",
    "attribution": "Direct logit attribution to sublayers and heads (final norm frozen), linearisation error per "
                   "head, and a delta-rule head's split over source tokens (--sources LAYER --position T).",
}
"""Probe name -> one-line description (the CLI lists these)."""

TYPED_INPUT = ("lens", "attribution")
"""Probes that also read typed input (`--text` / `--tokens` with `--checkpoint`, no `--store`)."""

__all__ = ["PROBES", "TYPED_INPUT"]
