"""Probe: which step of the schedule benchmark makes CUDA-graph capture fail (one variant per process)."""
import sys, traceback, warnings
import torch, torchvision
import seqify

variant = sys.argv[1]
arch, batch, chunks = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.manual_seed(0)
seq = seqify.convert(getattr(torchvision.models, arch)())
x = torch.randn(batch, 3, 224, 224, device="cuda:0")
y = torch.randint(0, 1000, (batch,), device="cuda:0")
pipe = seqify.pipeline(seq, gpus=1, balance=[len(seq)], chunks=chunks, checkpoint="never", graphs=True,
                       schedule=variant.split("+")[0])
if "plan" in variant:
    pipe.plan_memory(x)
if "opt" in variant:
    opt = torch.optim.SGD(pipe.parameters(), lr=0.01)
    opt.zero_grad(set_to_none=True)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    loss = pipe.step(x, y, torch.nn.functional.cross_entropy)
torch.cuda.synchronize()
print(variant, arch, batch, chunks, "graphs" if pipe.graph_error is None else "FELL BACK", float(loss),
      f"peak alloc {torch.cuda.max_memory_allocated() / 2**30:.2f} reserved {torch.cuda.max_memory_reserved() / 2**30:.2f} GiB",
      flush=True)
if pipe.graph_error:
    print(pipe.graph_error[-3000:])
