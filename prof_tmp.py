import time

import torch

from kernels.ranks import _boundaries, resolve_method, state_metrics, state_rank_metrics
from kernels.spectra import householder_spectra
from probes.linalg import warm_up

dev="cuda"; warm_up(dev)
B,T,H,K=4,2048,32,128
k=torch.nn.functional.normalize(torch.randn(B,T,1,H,K,device=dev),dim=-1); v=torch.randn(B,T,1,H,K,device=dev); b=torch.rand(B,T,1,H,device=dev); g=-torch.rand(B,T,H,device=dev)*0.1
def t(name, f, reps=3):
    f(); torch.cuda.synchronize(); t0=time.perf_counter()
    for _ in range(reps): f()
    torch.cuda.synchronize(); print(f"{name}: {(time.perf_counter()-t0)/reps*1e3:.1f} ms", flush=True)
print("method", resolve_method("auto", torch.device(dev)))
t("boundaries (chunk fwd)", lambda: _boundaries(k,v,b,g,None,64,False))
bd=_boundaries(k,v,b,g,None,64,False)
s=bd[:, 1:33].reshape(-1,K,K).contiguous()
print("states", s.shape)
t("state_metrics 4096 mats", lambda: state_metrics(s))
for m in ("gram64","triton","svd"):
    try: t(f"state_metrics {m}", lambda: state_metrics(s, m), reps=1)
    except Exception as e: print(m, "fail", e)
t("ranks every 64", lambda: state_rank_metrics(k,v,b,g,None,every=64))
t("ranks every 256", lambda: state_rank_metrics(k,v,b,g,None,every=256))
t("spectra token", lambda: householder_spectra(k,b,None).eigenvalues.cpu())
t("spectra window4", lambda: householder_spectra(k,b,None,window=4,stride=4).eigenvalues.cpu())
