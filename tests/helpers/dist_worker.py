"""One rank of a distributed pipeline test: run training steps, save losses, gradients, parameters (torchrun)."""

from __future__ import annotations

import argparse
import datetime
import os
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import seqify
import seqify.distributed as sd
from seqify import checkpoint
from seqify.distributed.link import Link
from seqify.schedule.actions import Action, Schedule, zb_h1


class Tiny(nn.Module):
    """A few Linear layers and a skip that crosses stages (balance 3,3 cuts between stash and pop)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 3)
        self.register_buffer("unused", torch.arange(3.0))  # forward never reads it; checkpoints keep it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        return self.c(torch.relu(self.b(h)) + h)


class Skippy(nn.Module):
    """Six Linear layers and three skips (14 layers converted): balance 3,3,4,4 cuts every skip across
    partitions, some between partitions of one rank and some across ranks, round-robin or in a V."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)
        self.d = nn.Linear(8, 8)
        self.e = nn.Linear(8, 8)
        self.f = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h1 = torch.relu(self.a(x))
        h2 = torch.relu(self.b(h1))
        h3 = torch.relu(self.c(h2)) + h1
        h4 = torch.tanh(self.d(h3)) + h2
        return self.f(torch.relu(self.e(h4)) * h1)


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "tiny":
        return Tiny()
    if name == "skippy":
        return Skippy().double()
    if name == "resnet18":
        import torchvision

        return torchvision.models.resnet18(num_classes=10)
    if name == "llama":  # export-converted: the batch size skips across layers as a size (an int)
        import transformers

        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, use_cache=False)
        return transformers.LlamaForCausalLM(cfg).double()
    if name == "gpt2":  # its LM head is tied to the token embedding; no dropout, so ranks and one process agree
        import transformers

        cfg = transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=16, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
        return transformers.GPT2LMHeadModel(cfg).double()
    return seqify.zoo.unet(depth=3, blocks=1, channels=4, out_channels=2)


def data(name: str, batch: int, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1 + step)
    if name == "tiny":
        return torch.randn(batch, 6, generator=g), torch.randint(0, 3, (batch,), generator=g)
    if name == "skippy":
        return torch.randn(batch, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (batch,), generator=g)
    if name == "resnet18":
        return torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, 10, (batch,), generator=g)
    if name in ("llama", "gpt2"):
        return torch.randint(0, 64, (batch, 8), generator=g), torch.randint(0, 64, (batch, 8), generator=g)
    return torch.randn(batch, 3, 16, 16, generator=g), torch.randn(batch, 2, 16, 16, generator=g)


def one_rank_zb(partitions: int, chunks: int) -> Schedule:
    """Zero bubble (ZB-H1, split B and W) for ``partitions`` partitions all held by one rank: the
    one-partition-per-device schedule's actions in its order, every one on device 0."""
    plan = zb_h1(tuple(range(partitions)), chunks)
    actions = tuple(Action(0, a.partition, a.microbatch, a.kind) for a in plan.actions)
    return Schedule("zb-h1", (0,) * partitions, chunks, actions, split=True)


def converted(name: str, model: nn.Module) -> nn.Module:
    """``model`` as seqify layers: the export frontend for the transformers model, fx for the others."""
    if name in ("llama", "gpt2"):
        return seqify.convert(model, example_inputs={"input_ids": data(name, 4)[0]}, frontend="export")
    return seqify.convert(model)


def lm_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    """A causal language model's loss on its logits (every position's next token given as ``target``)."""
    return F.cross_entropy(out.logits.flatten(0, 1), target.flatten())


def loss_fn(name: str):  # type: ignore[no-untyped-def]
    if name in ("llama", "gpt2"):
        return lm_loss
    return F.mse_loss if name == "unet" else F.cross_entropy


def as_torchrun(rank: int, world: int, port: int, argv: list[str]) -> None:
    """:func:`main` in rank ``rank`` of ``world`` started by ``procs.spawn``, with the environment torchrun gives
    a rank on one machine (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    main(argv)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="resnet18")
    p.add_argument("--balance", default="params")
    p.add_argument("--stages", type=int, default=0)
    p.add_argument("--chunks", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--checkpoint", default="never")
    p.add_argument("--out", required=True)
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument("--backend", default="gloo")
    p.add_argument("--schedule", default="gpipe")
    p.add_argument("--loops", type=int, default=1, help="partitions per rank")
    p.add_argument("--steps", type=int, default=1, help="SGD steps (more than 1: train() below)")
    p.add_argument("--save-after", type=int, default=0, help="checkpoint to --ckpt after this many steps")
    p.add_argument("--resume", action="store_true", help="load --ckpt first, then run the remaining steps")
    p.add_argument("--ckpt", default="")
    p.add_argument("--timeout", type=float, default=60)
    p.add_argument("--graphs", action="store_true", help="fixed programs per micro-batch (CUDA graphs on GPUs)")
    p.add_argument("--config", default="", help="a saved PipeConfig giving the layout (the options above unused)")
    p.add_argument("--bf16", action="store_true", help="train() steps under bf16 autocast")
    p.add_argument("--lr", type=float, default=0.1, help="train()'s SGD learning rate")
    p.add_argument("--input-grad", action="store_true", help="one step on an input that requires grad")
    args = p.parse_args(argv)
    if args.backend == "nccl":
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.deterministic = True
        torch.backends.cuda.matmul.allow_tf32 = False
    sd.init(args.backend, timeout_s=args.timeout)
    rank = torch.distributed.get_rank()
    model = build(args.model).train()
    seq = seqify.convert(model)
    if args.balance in ("params", "flops", "time"):
        balance: list[int] | str = args.balance
    else:
        balance = [int(b) for b in args.balance.split(",")]
    if args.config:
        stage = sd.stage(seq, config=args.config)
    else:
        stage = sd.stage(seq, balance=balance, chunks=args.chunks, checkpoint=args.checkpoint,
                         schedule=args.schedule, graphs=args.graphs, loops=args.loops,
                         sample=torch.randn(2, 3, 32, 32) if args.balance in ("flops", "time") else None)
    if rank == args.fail_rank:
        raise RuntimeError(f"planned failure on rank {rank}")
    if args.steps > 1 or args.resume:
        train(args, model, stage)
        return
    x, y = data(args.model, args.batch)
    if args.backend == "nccl":
        x, y = x.to(stage.device), y.to(stage.device)
    shard = slice(stage.replica * args.batch // stage.replicas, (stage.replica + 1) * args.batch // stage.replicas)
    given = x[shard].detach().requires_grad_(args.input_grad)
    loss = stage.step(given if stage.is_first else None, y[shard] if stage.is_last else None,
                      loss_fn=loss_fn(args.model))
    names = {id(p): n for n, p in model.named_parameters()}
    grads = {names[id(p)]: p.grad.detach().cpu().clone() for p in stage.partition.parameters() if p.grad is not None}
    with torch.no_grad():
        out = stage(x[shard]) if stage.is_first else stage()
    loss = None if loss is None else loss.cpu()
    out = None if out is None else out.cpu()
    torch.save({"loss": loss, "grads": grads, "replica": stage.replica, "stage": stage.index,
                "balance": stage.balance, "output": out,
                "input_grad": given.grad.cpu() if stage.is_first and given.grad is not None else None},
               os.path.join(args.out, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


def train(args: argparse.Namespace, model: nn.Module, stage: sd.DistributedStage) -> None:
    """``--steps`` SGD steps (momentum) of the pipeline; saves after ``--save-after`` or resumes from ``--ckpt``.

    With ``--steps`` far above what the test waits for, the job runs until the test kills a node; each
    rank touches ``started{rank}`` after its first step so the test knows training is under way."""
    opt = torch.optim.SGD(stage.parameters(), lr=args.lr, momentum=0.9)
    first = checkpoint.load(stage, args.ckpt, opt).step if args.resume else 0
    losses: dict[int, float] = {}
    rank = torch.distributed.get_rank()
    shard = slice(stage.replica * args.batch // stage.replicas, (stage.replica + 1) * args.batch // stage.replicas)
    names = {id(p): n for n, p in model.named_parameters()}

    def slow_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        time.sleep(0.005)  # a step of the tiny model is short: keep the ranks mid-step while the kill test strikes
        return loss_fn(args.model)(out, target)

    for step in range(first, args.steps):
        x, y = data(args.model, args.batch, step)
        opt.zero_grad()
        with torch.autocast(stage.device.type, dtype=torch.bfloat16, enabled=args.bf16):
            loss = stage.step(x[shard] if stage.is_first else None, y[shard] if stage.is_last else None,
                              loss_fn=slow_loss)
        opt.step()
        if loss is not None:
            losses[step] = float(loss)
        if step == first:
            open(os.path.join(args.out, f"started{rank}"), "w").close()
        if step + 1 == args.save_after:
            checkpoint.save(stage, args.ckpt, opt, step=step + 1)
    torch.save({"losses": losses, "stage": stage.index, "replica": stage.replica,
                "params": {names[id(p)]: p.detach().clone() for p in stage.partition.parameters()},
                "grads": {names[id(p)]: p.grad.clone() for p in stage.partition.parameters() if p.grad is not None},
                "optimizer": opt.state_dict()},
               os.path.join(args.out, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


def spawned(rank: int, world: int, port: int, out: str, name: str, balance: list[int], schedule: Any, loops: int,
            chunks: int, batch: int, checkpoint: str, ckpt: str, fail_rank: int = -1, graphs: bool = False) -> None:
    """One rank started by ``torch.multiprocessing.spawn``: two SGD steps of ``name`` on its replica's shard,
    saving each step's loss and gradients (source names) to ``out/rank{rank}.pt``; with ``ckpt``, saves a
    checkpoint after the first step and loads it into a freshly built stage, whose parameters it reports.
    ``fail_rank`` dies (``os._exit``) in its first step's loss; the others write the error they raise.
    ``graphs`` trains through fixed programs per micro-batch (eager on the CPU)."""
    torch.set_num_threads(1)
    try:
        _spawned(rank, world, port, out, name, balance, schedule, loops, chunks, batch, checkpoint, ckpt, fail_rank,
                 graphs)
    except seqify.SeqifyError as e:
        with open(os.path.join(out, f"error{rank}.txt"), "w") as f:
            f.write(f"{type(e).__name__}: {e}")
        raise


def _spawned(rank: int, world: int, port: int, out: str, name: str, balance: list[int], schedule: Any, loops: int,
             chunks: int, batch: int, checkpoint: str, ckpt: str, fail_rank: int, graphs: bool) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                         timeout=datetime.timedelta(seconds=60))
    try:
        model = build(name).train()
        stage = sd.stage(converted(name, model), balance=balance, chunks=chunks, checkpoint=checkpoint,
                         schedule=schedule, loops=loops, graphs=graphs)
        names = {id(p): n for n, p in model.named_parameters()}
        opt = torch.optim.SGD(stage.parameters(), lr=0.1, momentum=0.9)
        sent: list[tuple[tuple[int, int, int], int]] = []  # (key, destination) of every message this rank sends
        send = Link.send

        def logged(self: Link, key: tuple[int, int, int], value: Any, dst: int) -> None:
            sent.append((key, dst))
            send(self, key, value, dst)

        Link.send = logged  # type: ignore[method-assign]
        booked, quiet = Link._booked, [0]  # messages received as the last step's book said, without waiting for headers

        def counted(self: Link, src: int, what: str, side: Any) -> Any:
            quiet[0] += 1
            return booked(self, src, what, side)

        Link._booked = counted  # type: ignore[method-assign]
        record: dict[str, Any] = {"stage": stage.index, "owned": stage.owned, "replica": stage.replica, "losses": [],
                                  "grads": [], "quiet": []}
        shard = slice(stage.replica * batch // stage.replicas, (stage.replica + 1) * batch // stage.replicas)

        def loss_of(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            if rank == fail_rank:
                os._exit(3)  # as if killed: no exception, no goodbye to the peers
            return loss_fn(name)(output, target)

        for step in range(2):
            x, y = data(name, batch, step)
            x, y = x[shard], y[shard]
            opt.zero_grad()
            loss = stage.step(x if stage.is_first else None, y if stage.is_last else None, loss_fn=loss_of)
            record["losses"].append(None if loss is None else float(loss))
            record["quiet"].append(quiet[0])
            quiet[0] = 0
            record["grads"].append({names[id(p)]: p.grad.clone() for p in stage.partition.parameters()
                                    if p.grad is not None})
            opt.step()
            if step == 0 and ckpt:
                sd.save(stage, ckpt, opt, extra=1)
        # graphs=True: per partition, which of its micro-batch programs recompute (are checkpointed)
        record["programs"] = {p: [q is not None and q.flat.checkpoint is not None for q in r.programs]
                              for p, r in stage._programs.items()}
        # ... and which of them run B and W apart (a split schedule's programs)
        record["split"] = {p: [q is not None and q.split for q in r.programs] for p, r in stage._programs.items()}
        # ... and the size skips each holds as its micro-batch's constants: popped (given) and stashed (kept)
        record["sizes"] = {p: [(q.flat.given, q.flat.kept) if q is not None else None for q in r.programs]
                           for p, r in stage._programs.items()}
        with torch.no_grad():
            x, _ = data(name, batch, 0)
            record["output"] = stage(x[shard]) if stage.is_first else stage()
        if ckpt:
            fresh = build(name).train()
            again = sd.stage(converted(name, fresh), balance=balance, chunks=chunks, schedule=schedule, loops=loops)
            fopt = torch.optim.SGD(again.parameters(), lr=0.1, momentum=0.9)
            record["extra"] = sd.load(again, ckpt, fopt)
            fnames = {id(p): n for n, p in fresh.named_parameters()}
            record["loaded"] = {fnames[id(p)]: p.detach().clone() for p in again.partition.parameters()}
            record["momentum"] = {fnames[id(p)]: fopt.state[p]["momentum_buffer"].clone()
                                  for p in again.partition.parameters()}
        record["sent"] = sent
        torch.save(record, os.path.join(out, f"rank{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()



class PaddedLM(nn.Module):
    """A tiny language model (8 layers converted) whose logits come out (batch, classes, positions)."""

    def __init__(self) -> None:
        super().__init__()
        self.e = nn.Embedding(11, 8)
        self.h = nn.Linear(8, 8)
        self.g = nn.Linear(8, 8)
        self.o = nn.Linear(8, 11)

    def forward(self, i: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.h(self.e(i)))
        return self.o(torch.relu(self.g(h)) + h).transpose(1, 2)


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Eight samples of six tokens whose targets are padded (-100) past lengths that differ across
    micro-batches and replicas (one sample holds no target at all)."""
    g = torch.Generator().manual_seed(5)
    ids, target = torch.randint(0, 11, (8, 6), generator=g), torch.randint(0, 11, (8, 6), generator=g)
    for row, n in enumerate([6, 1, 4, 6, 0, 3, 5, 2]):
        target[row, n:] = -100
    return ids, target


def masked_mean(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    keep = target != -100
    return (F.cross_entropy(out, target.clamp(min=0), reduction="none") * keep).sum() / keep.sum()


def summed_ce(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, target, reduction="sum")


#: loss name -> (loss_fn, step keywords): torch's count, a user's denominator, a probed sum
PADDED_LOSSES: dict[str, tuple[Any, dict[str, Any]]] = {
    "ce": (nn.CrossEntropyLoss(), {}),
    "masked": (masked_mean, {"denominator": lambda t: (t != -100).sum()}),
    "sum": (summed_ce, {}),
}


def padded_spawned(rank: int, world: int, port: int, out: str, balance: list[int], schedule: str, loops: int,
                   chunks: int, graphs: bool) -> None:
    """One rank started by ``torch.multiprocessing.spawn``: one step of each of :data:`PADDED_LOSSES` on its
    replica's shard of :func:`padded_batch`, saving each loss and the gradients (source names)."""
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                         timeout=datetime.timedelta(seconds=60))
    try:
        torch.manual_seed(0)
        model = PaddedLM().double().train()
        stage = sd.stage(seqify.convert(model), balance=balance, chunks=chunks, schedule=schedule, loops=loops,
                         graphs=graphs)
        names = {id(p): n for n, p in model.named_parameters()}
        x, y = padded_batch()
        shard = slice(stage.replica * 8 // stage.replicas, (stage.replica + 1) * 8 // stage.replicas)
        record: dict[str, Any] = {"replica": stage.replica}
        for name, (loss_fn, keywords) in PADDED_LOSSES.items():
            stage.zero_grad()
            loss = stage.step(x[shard] if stage.is_first else None, y[shard] if stage.is_last else None,
                              loss_fn=loss_fn, **keywords)
            record[name] = (None if loss is None else float(loss),
                            {names[id(p)]: p.grad.clone() for p in stage.partition.parameters() if p.grad is not None})
        torch.save(record, os.path.join(out, f"rank{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()

def clip_spawned(rank: int, world: int, port: int, out: str, balance: list[int], loops: int) -> None:
    """One rank started by ``torch.multiprocessing.spawn``: one step of Skippy on its replica's shard, then
    ``seqify.clip_grad_norm_`` by the 2-norm and, on the same gradients again, by the inf-norm; saves the
    gradients before and after each (source names) and the totals."""
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                         timeout=datetime.timedelta(seconds=60))
    try:
        model = build("skippy").train()
        schedule = "interleaved" if loops > 1 else "1f1b"
        stage = sd.stage(seqify.convert(model), balance=balance, chunks=2, schedule=schedule, loops=loops)
        names = {id(p): n for n, p in model.named_parameters()}
        x, y = data("skippy", 8, 0)
        shard = slice(stage.replica * 8 // stage.replicas, (stage.replica + 1) * 8 // stage.replicas)
        stage.step(x[shard] if stage.is_first else None, y[shard] if stage.is_last else None, loss_fn=F.cross_entropy)
        mine = [p for p in stage.partition.parameters() if p.grad is not None]
        record: dict[str, Any] = {"replica": stage.replica, "grads": {names[id(p)]: p.grad.clone() for p in mine}}
        for norm in (2.0, "inf"):
            for p, g in zip(mine, record["grads"].values()):
                p.grad.copy_(g)
            total = seqify.clip_grad_norm_(stage, 1e-3, norm_type=norm)
            record[norm] = (total, {names[id(p)]: p.grad.clone() for p in mine})
        torch.save(record, os.path.join(out, f"rank{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()


class ModeNet(nn.Module):
    """Its blocks double their output in train mode and halve it in eval mode: ops that differ between the modes,
    which an export conversion holds per mode in one layer."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 16)
        self.blocks = nn.ModuleList([ModeBlock(), ModeBlock()])
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class ModeBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.f(x))
        return y * 2.0 if self.training else y * 0.5


def modes_spawned(rank: int, world: int, port: int, out: str, steps: int) -> None:
    """One rank started by ``procs.spawn``: ``steps`` rounds of a training step (SGD) and an evaluation forward of
    ModeNet, converted once by the export frontend, over ``world`` ranks; saves losses and outputs."""
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                         timeout=datetime.timedelta(seconds=60))
    try:
        torch.manual_seed(0)
        model = ModeNet().double().train()
        x, y = data("skippy", 8)
        seq = seqify.convert(model, x, frontend="export")
        assert seq.two_mode_layers and not seq.mode_dependent, seq.summary()
        stage = sd.stage(seq, balance=[3, len(seq) - 3], chunks=2, schedule="1f1b")
        opt = torch.optim.SGD(stage.parameters(), lr=0.1)
        record: dict[str, Any] = {"losses": [], "outputs": []}
        for _ in range(steps):
            stage.train()
            opt.zero_grad()
            loss = stage.step(x if stage.is_first else None, y if stage.is_last else None, loss_fn=F.cross_entropy)
            opt.step()
            stage.eval()
            with torch.no_grad():
                output = stage(x if stage.is_first else None)
            record["losses"].append(None if loss is None else float(loss))
            record["outputs"].append(output)
        torch.save(record, os.path.join(out, f"rank{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()
