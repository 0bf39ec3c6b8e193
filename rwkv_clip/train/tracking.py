"""Experiment tracking: TensorBoard and Weights & Biases behind one ``scalars(step, **values)``.

``--report-to tensorboard,wandb`` picks the targets; rank 0 writes; wandb is imported only
when asked for and runs offline without a key or server (docs/linear-probe-and-validation.md).
"""
from __future__ import annotations

import json
import os
import secrets
import socket
from pathlib import Path

from ..errors import TrainArgsError
from .logger import Board

TARGETS = ("tensorboard", "wandb")
WANDB_HOST = ("api.wandb.ai", 443)
RUN_ID_FILE = "run_id"


def parse_report_to(text: str | None) -> list[str]:
    """'tensorboard,wandb' -> ['tensorboard', 'wandb']; 'all'; 'none' or '' -> []."""
    names = [t.strip().lower() for t in (text or "").split(",") if t.strip()]
    if names == ["all"]:
        return list(TARGETS)
    if names == ["none"]:
        return []
    bad = [n for n in names if n not in TARGETS]
    if bad:
        raise TrainArgsError(f"--report-to {text!r}: unknown target {bad[0]!r}; expected a comma "
                             f"list of {', '.join(TARGETS)}, or all, or none")
    return list(dict.fromkeys(names))


def add_tracking_flags(p) -> None:
    g = p.add_argument_group("experiment tracking (open_clip's flags)")
    g.add_argument("--report-to", default="tensorboard", metavar="LIST",
                   help="comma list of tensorboard, wandb (or all, none). wandb runs offline "
                        "(written under OUTPUT/wandb, 'wandb sync' uploads it) without an API "
                        "key or network, or with WANDB_MODE=offline")
    g.add_argument("--wandb-project-name", default="rwkv-clip",
                   help="wandb project of the run")
    g.add_argument("--name", default=None,
                   help="the run's name (wandb run name); without --output the run folder "
                        "is runs/NAME. Default: the --output folder's name")


def resolve_tracking(args) -> None:
    """Check the tracking flags; set ``args.report_to`` (a list) and ``args.name``.
    ``--tensorboard False`` removes TensorBoard from the targets."""
    targets = parse_report_to(getattr(args, "report_to", "tensorboard"))
    if getattr(args, "tensorboard", True) is False and "tensorboard" in targets:
        targets.remove("tensorboard")
    if "wandb" in targets:
        try:
            import wandb  # noqa: F401 - asked for: a missing package stops the run here
        except ImportError:
            raise TrainArgsError("--report-to wandb needs the wandb package: "
                                 "pip install wandb") from None
    args.report_to = targets
    explicit = getattr(args, "explicit", None) or ()
    if getattr(args, "name", None):
        if "output" not in explicit and args.output == "runs/default":
            args.output = str(Path("runs") / args.name)
    else:
        args.name = Path(args.output).name


def wandb_reachable(timeout: float = 3.0) -> bool:
    """An API key is configured and the wandb server answers on its port."""
    if not os.environ.get("WANDB_API_KEY"):
        netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
        try:
            if "api.wandb.ai" not in netrc.read_text():
                return False
        except OSError:
            return False
    try:
        with socket.create_connection(WANDB_HOST, timeout=timeout):
            return True
    except OSError:
        return False


def run_config(args) -> dict:
    """The run's flags as plain JSON values (what wandb shows as config)."""
    return json.loads(json.dumps({k: v for k, v in vars(args).items() if k != "explicit"},
                                 default=str))


class WandbRun:
    """One wandb run in ``OUTPUT/wandb`` (rank 0)."""

    def __init__(self, args, log=None) -> None:
        try:
            import wandb
        except ImportError:
            raise TrainArgsError("--report-to wandb needs the wandb package: "
                                 "pip install wandb") from None
        folder = Path(args.output) / "wandb"
        folder.mkdir(parents=True, exist_ok=True)
        id_file = folder / RUN_ID_FILE
        resuming = getattr(args, "resume", None) is not None and id_file.is_file()
        run_id = id_file.read_text().strip() if resuming else secrets.token_hex(4)
        id_file.write_text(run_id + "\n")
        mode = os.environ.get("WANDB_MODE") or ("online" if wandb_reachable() else "offline")
        self.run = wandb.init(project=args.wandb_project_name, name=args.name, id=run_id,
                              dir=str(args.output), config=run_config(args),
                              mode=mode,  # type: ignore[arg-type]
                              resume="allow", settings=wandb.Settings(silent=True))
        if log is not None:
            where = getattr(self.run, "dir", folder)
            log(f"wandb: run {args.name} ({run_id}, project {args.wandb_project_name}, {mode})"
                + (f"; upload later with: wandb sync {Path(where).parent}"
                   if mode == "offline" else ""))

    def scalars(self, step: int, values: dict) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class Trackers:
    """TensorBoard and/or wandb with :class:`.logger.Board`'s interface; no-op when not
    ``enabled`` (ranks other than 0)."""

    def __init__(self, args, enabled: bool, log=None) -> None:
        targets = getattr(args, "report_to", None)
        if targets is None or isinstance(targets, str):
            targets = parse_report_to(targets or "tensorboard")
        self.board = Board(args.output, enabled and "tensorboard" in targets)
        self.wandb = WandbRun(args, log) if enabled and "wandb" in targets else None

    @property
    def writer(self):
        return self.board.writer

    def scalars(self, step: int, **values: float | None) -> None:
        self.board.scalars(step, **values)
        if self.wandb is not None:
            kept = {k: v for k, v in values.items() if v is not None}
            if kept:
                self.wandb.scalars(step, kept)

    def close(self) -> None:
        self.board.close()
        if self.wandb is not None:
            self.wandb.close()
            self.wandb = None
