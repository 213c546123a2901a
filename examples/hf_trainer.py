"""Train a GPT-2 as a seqify pipeline with transformers' Trainer, and check it against the Trainer on the plain model.

    python examples/hf_trainer.py --steps 3         # a quick run on a CPU

The model is transformers' own GPT2LMHeadModel built from a tiny config (no download), converted by seqify's
export frontend and cut into two partitions, both on the CPU. The Trainer gets
the pipeline as its model, and ``PipelineTrainer`` overrides one method, ``training_step``: ``pipe.step`` runs
the forward, the model's own causal-LM loss on each micro-batch and the backward, in the pipeline's schedule.
Everything else is the Trainer's: data order, AdamW, the LR schedule, gradient clipping (``max_grad_norm``:
in one process torch's ``clip_grad_norm_`` sees every partition's gradients), gradient accumulation, logging.

Why it is exact: the Trainer averages a causal LM's loss over the tokens of the whole accumulated batch
(``num_items_in_batch``, the labels other than -100, counted as for the plain model). Each micro-batch's loss
is the model's own loss function summed over that micro-batch's tokens and divided by that same count, so the
micro-batch losses add up (``reduction='sum'``) to the loss the Trainer computes on the plain model, and their gradients
to its gradients. The run below trains both and prints whether the losses and gradient norms agree.
(``compute_loss`` alone cannot be overridden instead: the Trainer calls backward on what it returns, while a
scheduled pipeline interleaves backwards with forwards; ``loss = lm_loss(pipe(ids))`` in ``compute_loss`` does
work, as fill-drain GPipe with the loss on the whole batch.)
"""

from __future__ import annotations

import argparse
import copy
import functools
import tempfile
from typing import Any

import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import seqify


class PipelineTrainer(Trainer):
    """A Trainer whose model is a :class:`seqify.Pipeline` of a causal language model: each training step is
    ``pipe.step``, the micro-batch losses weighed to add up to the Trainer's loss on the whole batch."""

    def __init__(self, *args: Any, loss_function: Any, vocab_size: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lm_loss, self.vocab_size = loss_function, vocab_size

    def training_step(self, model: nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        model.train()
        inputs = self._prepare_inputs(inputs)
        ids, labels = inputs["input_ids"], inputs["labels"]
        if num_items_in_batch is None:  # the Trainer counts the labels of a model whose forward takes **kwargs
            raise ValueError("PipelineTrainer needs the Trainer's num_items_in_batch: give the dataset 'labels'")
        loss_fn = functools.partial(micro_batch_loss, self.lm_loss, self.vocab_size, num_items_in_batch)
        assert isinstance(model, seqify.Pipeline)
        return model.step(ids, labels, loss_fn, reduction="sum")


def micro_batch_loss(lm_loss: Any, vocab_size: int, count: Any, out: Any, labels: torch.Tensor) -> torch.Tensor:
    """The model's own causal-LM loss on one micro-batch: summed over its tokens, divided by the batch's count."""
    return lm_loss(out.logits, labels, vocab_size=vocab_size, num_items_in_batch=count)


def build(seed: int = 0) -> GPT2LMHeadModel:
    """A tiny GPT-2 (its LM head tied to the token embedding), without dropout so two runs can agree."""
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=16, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    return GPT2LMHeadModel(config)


def dataset(samples: int = 32, seq: int = 8) -> list[dict[str, torch.Tensor]]:
    """Random token sequences; labels are the ids with a padded tail (-100) of varying length."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (samples, seq), generator=g)
    labels = ids.clone()
    for row, keep in enumerate(torch.randint(2, seq + 1, (samples,), generator=g).tolist()):
        labels[row, keep:] = -100
    return [{"input_ids": i, "labels": t} for i, t in zip(ids, labels)]


def arguments(folder: str, steps: int, accumulation: int) -> TrainingArguments:
    return TrainingArguments(output_dir=folder, max_steps=steps, per_device_train_batch_size=8,
                             gradient_accumulation_steps=accumulation, learning_rate=1e-3, max_grad_norm=0.5,
                             logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, seed=0,
                             remove_unused_columns=False, disable_tqdm=True)


def logged(trainer: Trainer) -> list[tuple[float, float]]:
    """Each step's logged (loss, grad_norm)."""
    return [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]


def train_pipeline(source: GPT2LMHeadModel, steps: int, accumulation: int = 1,
                   chunks: int = 2) -> tuple[PipelineTrainer, seqify.Pipeline]:
    """``source`` (left untouched) converted, cut into two partitions and trained by a PipelineTrainer."""
    model = copy.deepcopy(source)
    ids = dataset()[0]["input_ids"][None].repeat(2, 1)
    seq = seqify.convert(model, example_inputs={"input_ids": ids}, frontend="export")
    pipe = seqify.pipeline(seq, devices=["cpu", "cpu"], chunks=chunks, schedule="1f1b")
    # The Trainer counts the tokens the loss averages over after the shift (labels[:, 1:]) for a model whose
    # loss_type names a causal-LM loss, and all labels otherwise (GPT-2's is None): count as for the source
    pipe.loss_type = model.loss_type
    with tempfile.TemporaryDirectory() as folder:
        trainer = PipelineTrainer(model=pipe, args=arguments(folder, steps, accumulation), train_dataset=dataset(),
                                  loss_function=model.loss_function, vocab_size=model.config.vocab_size)
        trainer.train()
    return trainer, pipe


def train_plain(source: GPT2LMHeadModel, steps: int, accumulation: int = 1) -> Trainer:
    """The stock Trainer on a copy of ``source``."""
    with tempfile.TemporaryDirectory() as folder:
        trainer = Trainer(model=copy.deepcopy(source), args=arguments(folder, steps, accumulation),
                          train_dataset=dataset())
        trainer.train()
    return trainer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--accumulation", type=int, default=1, help="gradient accumulation steps")
    args = p.parse_args()
    source = build()
    trainer, pipe = train_pipeline(source, args.steps, args.accumulation)
    print(f"{pipe!r}")
    mine, theirs = logged(trainer), logged(train_plain(source, args.steps, args.accumulation))
    for step, ((loss, norm), (ref, ref_norm)) in enumerate(zip(mine, theirs)):
        print(f"step {step}: loss {loss:.6f} (plain Trainer {ref:.6f}), grad norm {norm:.6f} ({ref_norm:.6f})")
    same = len(mine) == len(theirs) == args.steps and all(
        abs(a - b) <= 1e-5 * abs(b) + 1e-6 for pair in zip(mine, theirs) for a, b in zip(*pair))
    print(f"losses and gradient norms equal to the plain Trainer's (float32 rounding): {same}")


if __name__ == "__main__":
    main()
