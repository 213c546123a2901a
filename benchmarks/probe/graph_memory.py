"""Probe: peak GPU memory of a graphed pipe.step while building (first step) and in steady steps."""
import sys
import torch, torchvision
import seqify
print("seqify from", seqify.__file__)
schedule, loops = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
seq = seqify.convert(torchvision.models.resnet101())
n = len(seq)
bal = [n // loops] * (loops - 1) + [n - (n // loops) * (loops - 1)]
pipe = seqify.pipeline(seq, gpus=1, loops=loops, balance=bal, chunks=8, checkpoint="never", schedule=schedule, graphs=True)
x = torch.randn(128, 3, 224, 224, device="cuda:0"); y = torch.randint(0, 1000, (128,), device="cuda:0")
lf = torch.nn.CrossEntropyLoss()
opt = torch.optim.SGD(pipe.parameters(), lr=0.01)
torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
base = torch.cuda.memory_allocated()
pipe.step(x, y, lf); opt.step(); opt.zero_grad(set_to_none=True)
torch.cuda.synchronize()
print(f"{schedule} loops={loops}: weights+x {base/2**30:.2f} GiB; first step (build) peak {torch.cuda.max_memory_allocated()/2**30:.2f}, after {torch.cuda.memory_allocated()/2**30:.2f}", flush=True)
torch.cuda.reset_peak_memory_stats()
for _ in range(3):
    pipe.step(x, y, lf); opt.step(); opt.zero_grad(set_to_none=True)
torch.cuda.synchronize()
print(f"  steady peak {torch.cuda.max_memory_allocated()/2**30:.2f} reserved {torch.cuda.max_memory_reserved()/2**30:.2f}, error {pipe.graph_error is not None}", flush=True)
