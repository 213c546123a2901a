"""Probe: zero-bubble split programs captured on a GPU: where the first partition's weight gradients go."""
import copy, sys
import torch, torchvision
import seqify
print("seqify from", seqify.__file__)
torch.backends.cudnn.deterministic = True
torch.manual_seed(0)
src = torchvision.models.resnet18(num_classes=10).train()
twin = copy.deepcopy(src)
loops = int(sys.argv[1])
n = len(seqify.convert(copy.deepcopy(src)))
parts = loops
bal = [n // parts] * (parts - 1) + [n - (n // parts) * (parts - 1)]
opts = dict(gpus=1, loops=loops, balance=bal, chunks=4, checkpoint="never", schedule="zb-h1")
eager = seqify.pipeline(seqify.convert(src), **opts)
graphed = seqify.pipeline(seqify.convert(twin), **opts, graphs=True)
x = torch.randn(16, 3, 64, 64, device="cuda:0"); y = torch.randint(0, 10, (16,), device="cuda:0")
lf = torch.nn.CrossEntropyLoss()
print("loss", float(eager.step(x, y, lf)), float(graphed.step(x, y, lf)), "error", graphed.graph_error)
replay = graphed._graphed[1]
for j, row in enumerate(replay.programs):
    print("partition", j, "split", [p.split for p in row], "graphs", [tuple(g is not None for g in p.graphs) for p in row],
          "touched", sum(row[0].touched), "/", len(row[0].touched), "handoff", len(replay.handoff[j][0]),
          "acc norm", float(sum(a.float().norm() for a in replay.acc[j])) if replay.acc[j] else None)
for (name, p), q in list(zip(src.named_parameters(), twin.parameters()))[:3] + list(zip(src.named_parameters(), twin.parameters()))[-2:]:
    print(name, float(p.grad.norm()), None if q.grad is None else float(q.grad.norm()))
