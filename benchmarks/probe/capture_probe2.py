"""Probe: what about plan_memory's measuring pass breaks a later CUDA-graph capture (one variant per process)."""
import contextlib, gc, sys, warnings
import torch, torchvision
import seqify
from seqify.pipe import memory

variant, arch, batch, chunks = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.manual_seed(0)
seq = seqify.convert(getattr(torchvision.models, arch)())
x = torch.randn(batch, 3, 224, 224, device="cuda:0")
y = torch.randint(0, 1000, (batch,), device="cuda:0")
pipe = seqify.pipeline(seq, gpus=1, balance=[len(seq)], chunks=chunks, checkpoint="never", graphs=True)
if variant == "nohooks":
    memory.torch.autograd.graph.saved_tensors_hooks = lambda a, b: contextlib.nullcontext()
if variant in ("plan", "nohooks", "plan-gc"):
    pipe.plan_memory(x)
if variant == "plan-gc":
    gc.collect(); torch.cuda.synchronize()
if variant == "eagerfwd":
    with torch.enable_grad():
        out = seq(x[: batch // chunks])
    del out
if variant == "eagerstep":
    seq(x[: batch // chunks]).sum().backward()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    loss = pipe.step(x, y, torch.nn.functional.cross_entropy)
torch.cuda.synchronize()
print(variant, arch, batch, chunks, "graphs" if pipe.graph_error is None else "FELL BACK", flush=True)
