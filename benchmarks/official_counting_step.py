"""Times the official CoPE code's training step (facebookresearch/RAM, projects/cope) on CPU; run by
benchmarks/train_step.py with the PyTorch interpreter, not with jaxpe's.

It imports the official modules from a checkout (nothing of theirs is copied here) and does what their
`src.main.setup` + `Trainer.train` do, minus the CUDA calls (`torch.cuda.set_device`, memory stats): their argument
parser, tokenizer, data loader (pad to the longest sequence of the batch), model and `SupervisedWorld.train(batch)`,
which is one optimizer step (forward, loss, backward, Adam). Prints one JSON line: the step times in seconds.

    python official_counting_step.py --ram RAM/projects/cope --data DIR --pos-emb cope --steps 30 --warmup 5
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ram", required=True, help="path of RAM's projects/cope")
    parser.add_argument("--data", required=True, help="directory of train/valid/test .jsonl")
    parser.add_argument("--pos-emb", required=True, help="their --pos-emb: cope, abs or rel")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    parser.add_argument("--model-args", default="--nlayers 2 --hid-sz 128 --nheads 4 --block-size 128")
    ours = parser.parse_args()

    sys.path.insert(0, os.path.abspath(ours.ram))
    os.chdir(ours.ram)  # their modules import as `src.*`
    import torch
    from src import data, models
    from src.main import add_train_args
    from src.trainer import Trainer
    from src.utils import Batch
    from src.utils import logger as logger_mod

    if ours.threads:
        torch.set_num_threads(ours.threads)
    parser = argparse.ArgumentParser()
    add_train_args(parser)
    cfg = parser.parse_args([
        "--model", "simpledec", "--tokenizer", "simple", "--emb-tie", "--drop", "0.1", "--batch-sz", "32",
        "--lr", "0.00007", "--train-on", "answer", "--post-norm", "--no-cuda", "--data", ours.data,
        "--pos-emb", ours.pos_emb, *ours.model_args.split()])
    # src.main.setup without its CUDA calls
    models.set_block_size(cfg)
    logger_mod.preprocess_args(cfg)
    cfg.device = torch.device("cpu")
    torch.manual_seed(cfg.seed)
    logger = logger_mod.Logger(cfg)
    tokenizer = data.tokenizer.get_tokenizer(cfg)
    train_data, _, _, tokenizer = data.get_data(cfg, tokenizer)
    loader = data.get_loader(cfg, train_data, tokenizer)
    model = models.build(cfg, tokenizer).to(cfg.device)
    trainer = Trainer(cfg, model, logger, tokenizer)
    model.train(True)

    times, lengths = [], []
    batches = iter(loader)
    for i in range(ours.warmup + ours.steps):
        batch = Batch.from_dict(next(batches), cfg.device)
        start = time.perf_counter()
        trainer.world.train(batch, False)  # forward, loss, backward, optimizer.step
        elapsed = time.perf_counter() - start
        if i >= ours.warmup:
            times.append(elapsed)
            lengths.append(int(batch.x.shape[1]))
    print(json.dumps({"times": times, "lengths": lengths, "torch": torch.__version__,
                      "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
