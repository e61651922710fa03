"""The online-distillation settings of a command line (`adaspec serve --online-distill`,
`adaspec osd simulate`): its `--interval`, `--osd-*`, `--loss`, `--sampling` options as one
OnlineConfig, every bad value a one-line error from the config itself."""

from __future__ import annotations

from typing import Any

from adaspec.online.distill import DistillConfig
from adaspec.online.service import OnlineConfig


def online_config(args: Any) -> OnlineConfig:
    """The OnlineConfig of the command line's options (every bad value a one-line error)."""
    distill = DistillConfig(loss=args.loss, sampling=args.sampling, steps=args.osd_steps,
                            lr=args.osd_lr)
    return OnlineConfig(interval=args.interval, positions=args.osd_positions,
                        buffer=args.osd_buffer, top_k=args.osd_top_k, record=args.osd_record,
                        layers=args.osd_layers,
                        domains=args.osd_domains, distill=distill, root=args.osd_dir,
                        nice=args.osd_nice, head_lr=args.osd_head_lr,
                        head_grow=args.osd_head_grow, head_backoff=args.osd_head_backoff)
