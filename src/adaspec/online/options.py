"""The online-distillation settings of a command line (`adaspec serve --online-distill`,
`adaspec osd simulate`): its `--interval`, `--osd-*`, `--loss`, `--sampling` options as one
OnlineConfig, every bad value a one-line error from the config itself, naming the option."""

from __future__ import annotations

from typing import Any

from adaspec.errors import InputError
from adaspec.online.distill import DistillConfig
from adaspec.online.service import OnlineConfig

# each setting's option on the command line (an error names the option the user typed)
FLAGS = {"interval": "--interval", "positions": "--osd-positions", "buffer": "--osd-buffer",
         "top_k": "--osd-top-k", "layers": "--osd-layers", "steps": "--osd-steps",
         "head_lr": "--osd-head-lr", "head_grow": "--osd-head-grow",
         "head_backoff": "--osd-head-backoff"}


def online_config(args: Any) -> OnlineConfig:
    """The OnlineConfig of the command line's options (every bad value a one-line error
    naming its option)."""
    try:
        distill = DistillConfig(loss=args.loss, sampling=args.sampling, steps=args.osd_steps,
                                lr=args.osd_lr)
        return OnlineConfig(interval=args.interval, positions=args.osd_positions,
                            buffer=args.osd_buffer, top_k=args.osd_top_k,
                            record=args.osd_record, layers=args.osd_layers,
                            domains=args.osd_domains, distill=distill, root=args.osd_dir,
                            nice=args.osd_nice, head_lr=args.osd_head_lr,
                            head_grow=args.osd_head_grow, head_backoff=args.osd_head_backoff)
    except InputError as e:
        name, must, rest = str(e).partition(" must ")
        if must and name in FLAGS:
            raise InputError(f"{FLAGS[name]} must {rest}") from None
        raise
