"""One short GPU run: the KDA forward's persistent prep kernel vs the split prep (KdaConfig(split_prep=True)),
with fla 0.6.0's chunk_kda in the same run, at two grid points; errors against the float32 chunked form.

    python scripts/kda_split_check.py
"""

import torch

from benchmarks.kda import K, inputs, load_fla, reference, timed
from kernels.triton_kda import KdaConfig, triton_kda

fla, _ = load_fla()


def run(x, cfg):
    q, k, v, beta, g = x
    return triton_kda(q, k.unsqueeze(2), v.unsqueeze(2), beta.unsqueeze(2).float(), g, scale=K**-0.5, config=cfg,
                      output_boundary_states=False)


print(f"{torch.cuda.get_device_name(0)}: ms (best of 3), error vs float32 chunked form (max rel)")
for B, T, H in ((8, 8192, 32), (1, 2048, 16)):
    x = inputs(B, T, H, "cuda")
    ref = reference(*x)
    scale = ref.abs().max()
    for name, cfg in (("persistent", KdaConfig(split_prep=False)), ("split", KdaConfig(split_prep=True))):
        first, ms, out = timed(lambda x=x, cfg=cfg: run(x, cfg))
        err = float((out[0].float() - ref).abs().max() / scale)
        print(f"B={B} T={T} H={H} {name:>10}: {ms:7.2f} ms  first {first:5.1f} s  err {err:.1e}", flush=True)
    if fla is not None:
        first, ms, (o_f, _) = timed(lambda x=x: fla(x[0], x[1], x[2], x[4], x[3], scale=K**-0.5))
        print(f"B={B} T={T} H={H} {'fla':>10}: {ms:7.2f} ms  first {first:5.1f} s  "
              f"err {float((o_f.float() - ref).abs().max() / scale):.1e}", flush=True)
