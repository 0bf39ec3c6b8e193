"""The training loop: :func:`train` runs the whole job top to bottom, as nanoGPT's train.py.

Process group, model, data, resume, then epochs of optimizer steps (each one
:func:`~rwkv_clip.train.accumulation.train_step`) with checkpoints, zero-shot and
validation along the way; a final checkpoint, evaluation and clean shutdown.
"""
from __future__ import annotations

import functools
import gc
import json
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .. import faults, host_memory
from ..compiling import compile_model
from ..config import kept_settings_note
from ..distributed import (
    DistInfo,
    any_rank_true,
    barrier,
    cleanup_distributed,
    init_distributed,
    launch_environment,
    pick_device,
)
from ..errors import (
    NonFiniteLossError,
    ResumeError,
    RWKVCLIPError,
    TrainArgsError,
    TrainingError,
    run_cli,
)
from ..factory import build_model
from ..lora import LoraSettings, add_adapters, parameter_counts
from ..loss import ClipLoss, SigLipLoss
from ..model import get_model
from ..ops import check_wkv_environment, describe_wkv, dispatch, prepare_wkv_kernel
from ..precision import get_precision
from ..pretrained import load_weights
from . import checkpoint as ckpt_io
from .accumulation import StepResult, caption_generator, make_micro_batches, train_step
from .args import warn_ignored
from .logger import (
    SpeedLogger,
    close_logging,
    progress_bar,
    setup_logging,
)
from .rng import capture_rng, restore_rng
from .schedule import lr_at, set_lr
from .tracking import Trackers
from .validation import Validator

if TYPE_CHECKING:
    from ..data.loader import LoaderArgs


@dataclass
class RunState:
    """Where the run stands: what a checkpoint records and a resume restores."""
    step: int = 0               # optimizer steps done
    epoch: int = 0              # current epoch (0-based)
    batch_in_epoch: int = 0     # loader batches consumed in the current epoch
    last_saved: str | None = None  # newest checkpoint path (rank 0 only)
    last_saved_step: int = 0
    last_loss: float | None = None
    zero_shot_history: list[dict] = field(default_factory=list)


class Interrupted(BaseException):
    """SIGINT / SIGTERM stopped the run at a step boundary, after its checkpoint. A
    BaseException, as KeyboardInterrupt: no ``except Exception`` on the way may swallow it."""

    def __init__(self, signum: int | None, step: int) -> None:
        self.signum = signum or signal.SIGTERM
        self.step = step
        super().__init__(f"interrupted at step {step}; resume with --resume latest")

    @property
    def exit_code(self) -> int:
        return 128 + int(self.signum)  # 130 for SIGINT, 143 for SIGTERM, as a shell reports


class StopSignals:
    """SIGINT and SIGTERM (also what SLURM sends on preemption) as a request to stop at the
    next step boundary. A second SIGINT stops at once (KeyboardInterrupt)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum
        print(f"{signal.Signals(signum).name}: stopping after the current step (checkpoint "
              "first)", file=sys.stderr, flush=True)

    def requested(self, info: DistInfo) -> bool:
        """True on every rank once any rank got a signal (a collective under DDP)."""
        return any_rank_true(self.signum is not None, info)


def main(args) -> dict[str, Any]:
    """Train with resolved ``args`` (see ``rwkv_clip.train.args``); returns a summary."""
    if args.keep_checkpoints < 0:
        raise TrainArgsError(f"--keep-checkpoints must be >= 0 (0: keep all), got "
                             f"{args.keep_checkpoints}")
    info = init_distributed(args.device, timeout_minutes=args.dist_timeout / 60)
    # a lost peer from here on: one line, exit status 3 (rwkv_clip.faults)
    with faults.watch_peers(info, args.dist_timeout, "train.py") as watch:
        if info.is_master:  # before any work: a run that cannot save is not started
            ckpt_io.check_writable(args.output)
        log = setup_logging(args.output, info.rank, args.log_format)
        dispatch.set_reporter(log.info, log.warning)  # the table's choice lines in the log
        watch.log = log
        watch.outcome = functools.partial(lost_rank_outcome, args.output)
        resume_after_restart(args, log)
        finished = False
        stop = StopSignals()
        stop.install()  # a signal from here on: finish the step, save, exit 130 / 143
        try:
            result = train(args, info, log, stop, watch)
            finished = True
            return result
        except Exception as exc:
            watch.check(exc)  # a lost peer: the line and exit 3 here, before any teardown
            raise
        finally:
            stop.uninstall()
            gc.collect()  # DDP reducers must be gone before the group is destroyed
            watch.close("done" if finished else "interrupted")  # before the final barrier
            cleanup_distributed(info, synchronize=finished)
            if info.is_master:
                save_dispatch_choices(args.output)
            dispatch.set_reporter()
            close_logging()


def save_dispatch_choices(output: str) -> None:
    """The dispatch table's choices of this run, ``OUTPUT/dispatch.json`` (what ran, and
    what ``rwkv_clip.ops.dispatch.pin`` takes to run it again)."""
    chosen = dispatch.choices()
    if chosen:
        with open(os.path.join(output, "dispatch.json"), "w") as f:
            json.dump(chosen, f, indent=1, sort_keys=True)


def resume_after_restart(args, log) -> None:
    """Under torchrun ``--max-restarts N`` a restarted job continues from the newest
    checkpoint by itself, as if ``--resume latest`` were given."""
    attempt = faults.restart_count()
    if attempt == 0 or args.resume == "latest":
        if attempt:
            log.info(f"torchrun restart {attempt}: --resume latest")
        return
    newest = ckpt_io.newest_checkpoint(args.output)
    if newest is None and args.resume is not None:
        return  # nothing saved by the failed attempt: the given --resume still holds
    given = f" (instead of --resume {args.resume})" if args.resume else ""
    args.resume = "latest"
    if newest is not None:
        args.pretrained = None  # the checkpoint holds the weights
    log.info(f"torchrun restart {attempt}: resuming as with --resume latest{given}: "
             f"{newest or 'no checkpoint yet, starting again'}")


def lost_rank_outcome(output) -> str:
    """What a lost rank leaves: the newest complete checkpoint, and how to go on."""
    newest = ckpt_io.newest_checkpoint(output)
    how = ("torchrun restarts the job, which resumes by itself" if faults.restarts_left()
           else "resume with --resume latest")
    return f"last checkpoint: {newest or 'none yet'}; {how}"


def train(args, info: DistInfo, log, stop: StopSignals | None = None,
          watch: faults.PeerWatch | None = None) -> dict[str, Any]:
    """Set up, resume if asked, run the optimizer steps, summarise. ``stop``: SIGINT /
    SIGTERM end the run at the next step boundary with a checkpoint (:class:`Interrupted`).
    ``watch``: told the step, for the line a lost peer ends the run with."""
    stop = stop or StopSignals()
    ckpt_path = ckpt_io.resolve_resume(args.resume, args.output)
    ckpt = ckpt_io.load_checkpoint(ckpt_path) if ckpt_path is not None else None
    source = args.config_source
    if ckpt is not None:  # the run's settings (data, config, batch, schedule...) from it
        taken = ckpt_io.take_run_settings(ckpt, args, ckpt_path)
        source = f"the checkpoint {ckpt_path}"
        if taken:
            log.info("settings from the checkpoint: " +
                     ", ".join(f"{k}={v!r}" for k, v in taken.items()))
    elif args.resume == "latest":
        log.info(f"--resume latest: no checkpoint in {ckpt_io.checkpoint_dir(args.output)}, "
                 "starting fresh")
    log.info(f"rank {info.rank}/{info.world_size} on {info.device} "
             f"(backend {info.backend or 'none'}); model settings from {source}")
    warn_ignored(args, log.info)
    setting = getattr(args, "dispatch", "") or dispatch.AUTO
    if setting != dispatch.AUTO:  # pins or a run's choices, before any set-up
        log.info(f"dispatch: {dispatch.apply_setting(setting, '--dispatch')} "
                 "(the config key dispatch)")
    malloc_choice = host_memory.applied()
    if malloc_choice is not None:
        log.info(host_memory.describe(malloc_choice))
    # says so before a first-use compile, which then overlaps the model and data set-up
    kernel_ready = prepare_wkv_kernel(info.device, log.info, background=True)
    log.info(describe_wkv(info.device))
    try:
        model = build_train_model(args, info, log)
        data = prepare_data(args, info, log)
    except BaseException:
        kernel_ready(raise_error=False)
        raise
    kernel_ready()
    loss_fn = build_loss(args, info)
    optimizer = build_optimizer(model, args)
    precision = get_precision(args.precision, info.device)
    scaler, autocast = precision.scaler(), precision.autocast_factory
    schedule = dict(kind=args.lr_scheduler, max_lr=args.lr, total_steps=data.total_steps,
                    warmup=args.warmup)
    state = RunState()
    if watch is not None:
        watch.where = lambda: f"at step {state.step}"
    share_dispatch_choices(model, args, info, precision, log)
    rng = None  # this rank's RNG states from the checkpoint, restored once data flows
    if ckpt is not None:
        rng = resume(ckpt, ckpt_path, info, log, model, optimizer, scaler, state,
                     data.total_steps)
        del ckpt
    ddp_model: Any = model  # wrapped after loading, so every rank starts from the same weights
    if info.distributed:
        ddp_model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[info.device.index] if info.device.type == "cuda" else None,
            bucket_cap_mb=32, find_unused_parameters=False)
    if args.torchcompile:  # the step runs compiled; checkpoints keep saving plain `model`
        ddp_model = compile_model(ddp_model)
    save = functools.partial(save_run_checkpoint, model=model, optimizer=optimizer, scaler=scaler,
                             args=args, info=info, log=log, total_steps=data.total_steps)
    logs = Logs(args, info, log, state.step, data.total_steps, data.steps_per_epoch)
    validator = Validator(args, info, log, logs.board, state.step)
    k = args.gradient_acc
    epoch_batches = data.steps_per_epoch * k  # leftover batches (< K) make no step
    if state.epoch > 0:  # a resumed run: the loader starts at the checkpoint's epoch
        set_loader_epoch(data.loader, state.epoch)
    try:
        while state.epoch < args.epochs and state.step < data.total_steps:
            batches = iter(data.loader)
            for _ in range(state.batch_in_epoch):  # resumed mid-epoch: the data position
                next(batches)
            if rng is not None:  # after the iterator exists (it may draw seeds)
                restore_rng(rng, info.device)
                rng = None
            pending: list[tuple[torch.Tensor, torch.Tensor]] = []
            for images, tokens in batches:
                pending.append((images, tokens))
                if len(pending) < k:
                    continue
                # --- one optimizer step over K micro-batches; captions drawn for all K x m
                # samples at once from the step's own stream (independent of the split)
                captions = caption_generator(args.seed, info.rank, state.epoch,
                                             state.batch_in_epoch // k)
                micro_batches = make_micro_batches(
                    [p[0] for p in pending], [p[1] for p in pending], captions, info.device,
                    model.text_model.args.ctx_len, args.caption_weights)
                pending = []
                set_lr(optimizer, *lr_at(state.step, **schedule))
                try:
                    result = train_step(model, micro_batches, loss_fn, optimizer,
                                        scaler=scaler, autocast=autocast, mode=args.accum_mode,
                                        clip_grad_norm=args.grad_clip_norm, wrapped=ddp_model,
                                        info=info)
                except NonFiniteLossError as exc:
                    raise NonFiniteLossError(
                        f"stopping at step {state.step + 1} (epoch {state.epoch + 1}): {exc}; last "
                        f"good checkpoint: {state.last_saved or 'none saved yet'}. Try a lower "
                        "--lr, --precision bf16 or fp32, or --resume from the checkpoint."
                    ) from None
                del micro_batches  # the step's batches are freed before saving
                state.step += 1
                state.batch_in_epoch += k  # the state is always at a step boundary
                state.last_loss = result.loss
                # the speed line shows the next step's lr, as the original's did
                next_lr = lr_at(min(state.step, data.total_steps - 1), **schedule)[0]
                logs.step(state.step, result, next_lr, scaler)
                if args.save_every_steps and state.step % args.save_every_steps == 0:
                    save(f"step_{state.step}.pt", state)
                if stop.requested(info):  # SIGINT / SIGTERM: a checkpoint, then exit
                    raise Interrupted(stop.signum, state.step)
                if state.batch_in_epoch >= epoch_batches or state.step >= data.total_steps:
                    break
            if state.batch_in_epoch < epoch_batches:
                if state.step >= data.total_steps:
                    break  # --max-steps reached inside an epoch
                raise TrainingError(f"the loader ended epoch {state.epoch + 1} after "
                                    f"{state.batch_in_epoch} batches, fewer than its length "
                                    f"{data.micro_per_epoch}")
            for _ in batches:  # drain the leftover batches, then the next epoch's draws
                pass
            data.loader.reset()
            state.epoch += 1
            state.batch_in_epoch = 0
            save(f"epoch_{state.epoch}.pt", state)
            if stop.requested(info):
                raise Interrupted(stop.signum, state.step)
            if args.zero_shot_every and state.epoch % args.zero_shot_every == 0:
                metrics = zero_shot(model, data, args, info, log, logs, state.step,
                                    f"epoch {state.epoch}")
                state.zero_shot_history.append({"epoch": state.epoch, "step": state.step,
                                                **(metrics or {})})
            if validator.due(state.epoch):
                validator.run(model, state.step, state.epoch, f"epoch {state.epoch}")
        if state.step != state.last_saved_step:  # stopped inside an epoch (--max-steps)
            save(f"step_{state.step}.pt", state)
    except Interrupted:
        logs.close()
        if state.step != state.last_saved_step:
            save(f"step_{state.step}.pt", state)
        log.info(f"interrupted at step {state.step}; resume with --resume latest")
        raise
    except Exception as exc:
        logs.close()
        if stop.signum is not None and not info.distributed:  # e.g. loader workers that
            if state.step != state.last_saved_step:            # the same Ctrl-C stopped
                save(f"step_{state.step}.pt", state)
            log.info(f"interrupted at step {state.step}; resume with --resume latest")
            raise Interrupted(stop.signum, state.step) from None
        if _is_oom(exc):
            raise TrainingError(out_of_memory_message(exc, args)) from exc
        raise
    finally:
        logs.close_bar()
        del ddp_model  # before the process group goes (gloo aborts otherwise)
        gc.collect()
    validator.finish(model, state.step, state.epoch)
    final = None
    last = state.zero_shot_history[-1] if state.zero_shot_history else {}
    if args.final_zero_shot and last.get("step") == state.step and "acc1" in last:
        final = {k: v for k, v in last.items() if k not in ("epoch", "step")}  # no repeat
    elif args.final_zero_shot:
        final = zero_shot(model, data, args, info, log, logs, state.step, "final")
    logs.close()
    summary = summarise(state, model, final, logs.elapsed(), info, log, args, data.zero_shot_dir)
    summary["validation"] = validator.history
    return summary


# ----------------------------------------------------------------------------- setup

def build_train_model(args, info: DistInfo, log) -> get_model:
    """The model on its device, in train mode; identical initialisation on every rank."""
    seed_everything(args.seed)
    weights = load_weights(args.pretrained) if args.pretrained else None
    model = build_model(args.model_config, weights)
    if weights is not None:
        log.info(f"initial weights from {args.pretrained}")
        # a length or size other than the weights were trained at is allowed and said
        note = kept_settings_note(model.text_model.args, weights)
        if note:
            log.info(note)
    fit_logit_bias(model, args, log)
    lock_towers(model, args, log)
    add_lora_adapters(model, args, log)
    model.set_grad_checkpointing(bool(args.open_checkpoint))
    model.set_rebuild(args.rebuild)
    model.to(info.device).train()
    trainable, n_params = parameter_counts(model)
    log.info(f"RWKV-CLIP: {n_params:,} parameters, {trainable:,} trainable "
             f"({100 * trainable / n_params:.2f}%), precision {args.precision}, "
             f"activation checkpointing {'on' if args.open_checkpoint else 'off'}, "
             f"rebuild {args.rebuild}")
    seed_everything(args.seed + 1 + info.rank)  # per-rank dropout / drop-path streams
    return model


def share_dispatch_choices(model: torch.nn.Module, args, info: DistInfo, precision, log) -> None:
    """Under DDP without the config's ``dispatch`` (applied on every rank already): every
    rank runs rank 0's choices. Rank 0 makes them in one forward and backward of a
    synthetic batch of the run's shapes (its RNG states put back, its gradients dropped)
    and the other ranks adopt them. One process chooses each op on first use."""
    if not info.distributed or (getattr(args, "dispatch", "") or dispatch.AUTO) != dispatch.AUTO:
        return
    if info.is_master:
        from ..memory import synthetic_batch
        images, tokens = synthetic_batch(args, args.batch_size, info.device)
        devices = [info.device] if info.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), precision.autocast_factory():
            outputs = model(images, tokens)  # features, features, scale (and SigLIP's bias)
            (outputs[0].float().square().mean() + outputs[1].float().square().mean()).backward()
        model.zero_grad(set_to_none=True)
        del images, tokens, outputs
    box = [dispatch.choices() if info.is_master else None]
    torch.distributed.broadcast_object_list(box, src=0)
    if not info.is_master:
        dispatch.adopt(box[0] or {}, source="rank 0's choices")
    log.info(f"dispatch: every rank runs rank 0's {len(box[0] or {})} choice(s)")


def fit_logit_bias(model: get_model, args, log) -> None:
    """SigLIP needs ``logit_bias``: a fresh model gets open_clip's SigLIP init (scale ln 10,
    bias -10), CLIP weights (``--pretrained``) keep their scale and get bias -10. The CLIP
    loss has no use for one: a SigLIP checkpoint's bias is dropped."""
    from ..model import SIGLIP_LOGIT_BIAS

    siglip = bool(getattr(args, "siglip", False))
    if siglip and model.logit_bias is None:
        if args.pretrained:
            model.set_logit_bias(SIGLIP_LOGIT_BIAS)
            log.info(f"--siglip: logit_bias starts at {SIGLIP_LOGIT_BIAS:g} (the --pretrained "
                     "weights have none)")
        else:
            model.init_siglip()
    elif not siglip and model.logit_bias is not None:
        model.set_logit_bias(None)
        log.info("the --pretrained weights hold a SigLIP logit_bias: dropped for the CLIP "
                 "loss (add --siglip to keep training it)")


def build_loss(args, info: DistInfo) -> torch.nn.Module:
    """CLIP's softmax loss, or SigLIP's sigmoid loss with ``--siglip``."""
    if getattr(args, "siglip", False):
        return SigLipLoss(cache_labels=True, rank=info.rank, world_size=info.world_size,
                          dist_impl=args.siglip_dist_impl)
    return ClipLoss(local_loss=args.local_loss, gather_with_grad=args.gather_with_grad,
                    cache_labels=True, rank=info.rank, world_size=info.world_size)


@dataclass
class TrainData:
    """The training loader and the run's length in batches and optimizer steps."""
    loader: Any
    zero_shot_dir: str | None
    micro_per_epoch: int  # loader batches per epoch and rank
    steps_per_epoch: int
    total_steps: int
    shifted_dir: str | None = None  # the built-in set's distribution-shifted folder


def prepare_data(args, info: DistInfo, log) -> TrainData:
    from ..data import build_train_loader

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if args.workers and cpus and args.workers > cpus:  # more workers than cores only thrash
        log.info(f"--workers {args.workers} > the {cpus} CPU cores available: using {cpus}")
        args.workers = cpus
    train_data, data_format, zero_shot_dir, shifted_dir = locate_train_data(args, info, log)
    loader = build_train_loader(loader_args(args, info, train_data, data_format),
                                log=log.info if info.is_master else None)
    check_batch_fits(loader, args, info, data_name(args, train_data, data_format))
    micro_per_epoch = batches_per_epoch(loader, args, info)
    steps_per_epoch, total_steps = count_steps(micro_per_epoch, args)
    k = args.gradient_acc
    global_batch = args.batch_size * k * info.world_size
    log.info(f"{micro_per_epoch} batches/epoch/rank, {steps_per_epoch} optimizer steps/epoch, "
             f"{total_steps} steps in all; global batch {global_batch} "
             f"({args.batch_size} x {k} accumulation [{args.accum_mode}] x {info.world_size} "
             f"rank(s))")
    log.info(f"data loader: {loader_name(loader)}, {args.workers} worker(s) "
             f"(--loader {args.loader}; choices auto, dali, torch)")
    # exact values, so that report.png draws the schedule itself, not the rounded log lines
    log.info(f"learning rate: {args.lr_scheduler} schedule, peak {args.lr!r}, warmup "
             f"{args.warmup!r}, {total_steps} steps; weight decay {args.weight_decay!r} on "
             + ("all but norms, biases, 1-D parameters and logit_scale (--exclude-decay)"
                if args.exclude_decay
                else "every parameter"))
    if zero_shot_dir is None and (args.zero_shot_every or args.final_zero_shot):
        log.info("zero-shot evaluation: skipped, no image folder for this data; pass "
                 "--zero-shot-data DIR (one sub-folder of images per class) to evaluate after "
                 "every --zero-shot-every epoch(s) and at the end")
    return TrainData(loader, zero_shot_dir, micro_per_epoch, steps_per_epoch, total_steps,
                     shifted_dir)


def loader_name(loader) -> str:
    """Which pipeline reads the data, as the log names it."""
    kind = type(loader).__name__
    if kind == "DALIWrapper":
        return "DALI"
    if kind == "ParquetLoader":
        return "PyTorch DataLoader over parquet (pyarrow)"
    return "PyTorch DataLoader"


def locate_train_data(args, info: DistInfo, log) -> tuple[str, str, str | None, str | None]:
    """(train data, its format, zero-shot folder or None, the built-in set's shifted
    zero-shot folder or None)."""
    if args.data_format != "builtin":
        return args.train_data, args.data_format, args.zero_shot_data, None
    from ..data import ensure_builtin_dataset

    if info.is_master:  # rank 0 generates the set; the others wait, then find it ready
        ensure_builtin_dataset(root=args.builtin_root)
    barrier(info)
    builtin = ensure_builtin_dataset(root=args.builtin_root)
    tuning = (" (a fine-tune of your pairs needs --train-data)"
              if getattr(args, "pretrained", None) else "")
    log.info(f"built-in dataset (no --train-data given): {builtin.num_train} training pairs "
             f"at {builtin.root}{tuning}")
    return (builtin.train_prefix, "rec", args.zero_shot_data or builtin.zeroshot_dir,
            builtin.shifted_dir)


def data_name(args, train_data: str, data_format: str) -> str:
    """The training data as a message names it: the .rec file, else the flag's value."""
    from ..data.recordio import rec_paths

    name = rec_paths(train_data)[0] if data_format == "rec" else train_data
    return f"the built-in dataset {name}" if args.data_format == "builtin" else name


def check_batch_fits(loader, args, info: DistInfo, where: str) -> None:
    """Refuse a step batch larger than a rank's share of the training pairs.

    The loaders fill a short last batch with pairs of the same epoch (the original's FILL
    policy); for a batch that does not divide the shard that is a few repeats, but a
    batch larger than the shard would train on duplicates only because of the flags.
    The size comes from the loader (``num_samples``: usable pairs over all ranks) or, for
    a streaming loader, from ``--train-num-samples``; when neither says, nothing is
    checked.
    """
    pairs = getattr(loader, "num_samples", None)
    if pairs is None:
        pairs, where = args.train_num_samples, "--train-num-samples"
    if not pairs:
        return
    k, world = args.gradient_acc, info.world_size
    per_rank = int(pairs) // world  # the smallest shard (shards differ by at most one)
    need = args.batch_size * k
    if per_rank >= need:
        return
    spread = f" ({pairs} over {world} ranks)" if world > 1 else ""
    acc = f" x --gradient-acc {k}" if k > 1 else ""
    typed = getattr(args, "explicit", None)
    default = " (the default)" if typed is not None and "batch_size" not in typed else ""
    fit = per_rank // k  # the largest batch these pairs fill
    lower = "--batch-size" + (f" to {fit} or less" if fit else "") + (
        " or --gradient-acc" if k > 1 else "")
    raise TrainArgsError(
        f"--batch-size {args.batch_size}{default}{acc} x {world} rank(s) needs at least {need} "
        f"training pairs per rank, got {per_rank}{spread} in {where}; lower {lower}"
        + (" or use fewer ranks" if world > 1 else ""))


def batches_per_epoch(loader, args, info: DistInfo) -> int:
    try:
        return len(loader)
    except TypeError:  # a streaming loader: the length comes from --train-num-samples
        if not args.train_num_samples:
            raise TrainingError("the loader has no length: give --train-num-samples") from None
        return args.train_num_samples // info.world_size // args.batch_size


def count_steps(micro_per_epoch: int, args) -> tuple[int, int]:
    """(optimizer steps per epoch, steps in the whole run)."""
    k = args.gradient_acc
    steps_per_epoch = micro_per_epoch // k
    if steps_per_epoch < 1:
        raise TrainingError(f"an epoch has {micro_per_epoch} batch(es) of {args.batch_size} per "
                            f"rank, fewer than --gradient-acc {k}: lower --batch-size or "
                            "--gradient-acc")
    total_steps = args.epochs * steps_per_epoch
    if args.max_steps:
        total_steps = min(total_steps, args.max_steps)
    return steps_per_epoch, total_steps


# ----------------------------------------------------------------------------- resume, save

def state_dict_difference(model: torch.nn.Module, state: dict) -> str:
    """How ``state`` differs from ``model``'s state dict, in a few words: the counts of
    missing, unexpected and mis-shaped keys, and the first of each."""
    expected = model.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    shapes = [f"{k} {tuple(state[k].shape)} vs {tuple(expected[k].shape)}"
              for k in state if k in expected and state[k].shape != expected[k].shape]
    parts = [f"{len(items)} {what}, e.g. {items[0]}" for what, items in
             (("shape mismatches (checkpoint vs model)", shapes),
              ("keys the model lacks", unexpected), ("keys the checkpoint lacks", missing))
             if items]
    return "; ".join(parts) or "the values do not load"

def resume(ckpt: dict, path, info: DistInfo, log, model: torch.nn.Module,
           optimizer: torch.optim.Optimizer, scaler, state: RunState,
           total_steps: int) -> dict | None:
    """Load a checkpoint's weights, optimizer, scaler and counters into place; return this
    rank's saved RNG states (restored once the data iterator exists), or None.

    The learning rate needs nothing: ``lr_at`` is a function of the step (a format-1
    checkpoint's ``scheduler`` entry is ignored).
    """
    try:
        model.load_state_dict(ckpt["state_dict"])
    except RuntimeError:  # only after --resume-allow-changes changed the model
        raise ResumeError(f"--resume {path}: its weights do not fit the changed model "
                          f"settings ({state_dict_difference(model, ckpt['state_dict'])}); "
                          "a resume continues the checkpoint's model: drop the model "
                          "changes, or start a new run in another --output with "
                          f"--pretrained {path}") from None
    optimizer.load_state_dict(ckpt["optimizer"])
    if scaler is not None and ckpt.get("scaler"):
        scaler.load_state_dict(ckpt["scaler"])
    state.step, state.epoch = ckpt["step"], ckpt["epoch"]
    state.batch_in_epoch = ckpt["batch_in_epoch"]
    state.last_saved_step = state.step
    if ckpt.get("total_steps", total_steps) != total_steps:  # --epochs / --max-steps changed
        log.info(f"schedule length changed ({ckpt['total_steps']} -> {total_steps} steps): "
                 f"continuing the new schedule at step {state.step}")
    # epochs are counted from 1 as in the progress lines: state.epoch epochs are done
    log.info(f"resumed from {path}: step {state.step}, "
             + (f"epoch {state.epoch + 1} from its batch {state.batch_in_epoch + 1}"
                if state.batch_in_epoch else f"epoch {state.epoch + 1} from its start")
             + f" ({state.epoch} epoch(s) done)")
    rngs = ckpt["rng"]
    if isinstance(rngs, list) and len(rngs) == info.world_size:
        return rngs[info.rank]
    log.info("checkpoint RNG states are for another world size: reseeding instead")
    return None


def save_run_checkpoint(name: str, state: RunState, *, model, optimizer, scaler, args,
                    info: DistInfo, log, total_steps: int) -> None:
    """Every rank's RNG states go in, so every rank must call this; rank 0 writes."""
    rngs_all = _gather_rng(info)
    if info.is_master:
        ckpt = ckpt_io.build_checkpoint(model, optimizer, scaler, step=state.step,
                                        epoch=state.epoch, batch_in_epoch=state.batch_in_epoch,
                                        args=args, rng=rngs_all, total_steps=total_steps)
        with faults.writing():  # a stop for a lost peer waits for the file
            path = ckpt_io.save_checkpoint(
                ckpt, args.output, name, keep=args.keep_checkpoints,
                previous=state.last_saved if args.delete_previous_checkpoint else None)
        state.last_saved = str(path)
        log.info(f"saved {path}")
    state.last_saved_step = state.step
    barrier(info)


def _gather_rng(info: DistInfo) -> list:
    """Every rank's RNG states (for an exact resume), collected on all ranks."""
    mine = capture_rng(info.device)
    if not info.distributed:
        return [mine]
    import torch.distributed as dist
    gathered: list = [None] * info.world_size
    dist.all_gather_object(gathered, mine)
    return gathered


# ----------------------------------------------------------------------------- logs

class Logs:
    """Speed line (every rank counts, rank 0 prints), TensorBoard and tqdm bar (rank 0)."""

    def __init__(self, args, info: DistInfo, log, step: int, total_steps: int,
                 steps_per_epoch: int) -> None:
        self.info, self.log = info, log
        self.board = Trackers(args, info.is_master, log.info)
        self.speed = SpeedLogger(args.log_every, total_steps, info.world_size, start_step=step,
                                 fmt=args.log_format, steps_per_epoch=steps_per_epoch)
        self.bar = progress_bar(total_steps, step, args.progress and info.is_master)
        self.t_start = time.time()

    def step(self, step: int, result: StepResult, lr: float, scaler) -> None:
        loss = result.loss
        amp_scale = scaler.get_scale() if scaler is not None else 1.0
        line = self.speed.update(step=step, loss=loss, samples=result.samples, lr=lr,
                                 amp_scale=amp_scale)
        if not self.info.is_master:
            return
        self.board.scalars(step, loss=loss, lr=lr, logit_scale=result.logit_scale,
                           logit_bias=result.logit_bias,
                           samples_per_second=(self.speed.last_speed * self.info.world_size
                                               if line else None))
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}")
        if line:
            self.log.info(line)

    def elapsed(self) -> float:
        return time.time() - self.t_start

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def close(self) -> None:
        self.board.close()


# ----------------------------------------------------------------------------- zero-shot

def zero_shot(model: torch.nn.Module, data: TrainData, args, info: DistInfo, log, logs: Logs,
              step: int, tag: str) -> dict | None:
    """Zero-shot classification on the run's image folder (``rwkv_clip.eval``; sharded over
    the ranks when a process group is up, so every rank must call it); None without one.
    With the built-in set also on its shifted folder, logged with the tag ``TAG, shifted``
    and returned under ``"shifted"``."""
    folder = data.zero_shot_dir
    if not folder:
        return None
    from ..eval.zeroshot import evaluate_imagefolder

    def evaluate(where: str, label: str, scalar: str) -> dict:
        metrics = dict(evaluate_imagefolder(model, where, device=info.device,
                                            batch_size=min(args.batch_size, 256),
                                            input_size=args.input_size,
                                            precision=args.precision, workers=0))
        metrics["num_classes"] = sum(1 for entry in os.scandir(where) if entry.is_dir())
        if info.is_master:
            log.info(f"zero-shot ({label}) on {where}: {describe_zero_shot(metrics)}")
            logs.board.scalars(step, **{scalar: metrics["acc1"]})
        return metrics

    metrics = evaluate(folder, tag, "zeroshot/top1")
    if data.shifted_dir and os.path.isdir(data.shifted_dir):
        metrics["shifted"] = evaluate(data.shifted_dir, f"{tag}, shifted",
                                      "zeroshot/shifted_top1")
    return metrics


def describe_zero_shot(metrics: dict) -> str:
    top1 = metrics["acc1"]
    n = metrics.get("num_classes")
    text = f"top-1 {100 * top1:.1f}%"
    if metrics.get("acc5") is not None:
        text += f", top-5 {100 * metrics['acc5']:.1f}%"
    if n:
        text += f" (chance {100.0 / n:.1f}%: {n} classes)"
    return text


def summarise(state: RunState, model: torch.nn.Module, final: dict | None, elapsed: float,
              info: DistInfo, log, args, zero_shot_dir: str | None) -> dict[str, Any]:
    """The closing log lines, the run's report picture and the summary dict."""
    loss = state.last_loss
    if info.is_master:
        log.info(f"done: {state.step} steps in {elapsed / 60:.1f} min, last loss "
                 f"{loss if loss is None else round(loss, 4)}, checkpoint {state.last_saved}")
        if final is not None:
            log.info(f"final zero-shot accuracy: {describe_zero_shot(final)}")
            if final.get("shifted"):
                log.info("final zero-shot accuracy on the shifted split: "
                         f"{describe_zero_shot(final['shifted'])}")
        from ..report import write_report
        try:
            log.info(f"report: {write_report(args.output, model=model, zero_shot_dir=zero_shot_dir)}")
        except RWKVCLIPError as exc:  # the run and its checkpoints are fine without the picture
            log.info(f"report not drawn: {exc}")
    return {"steps": state.step, "epochs": state.epoch, "train_seconds": elapsed,
            "last_loss": loss, "checkpoint": state.last_saved, "zero_shot": final,
            "zero_shot_history": state.zero_shot_history, "model": model}


# ----------------------------------------------------------------------------- helpers

def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def is_no_decay(name: str, param: torch.Tensor) -> bool:
    return (param.ndim < 2 or "logit_scale" in name or name.endswith(".bias")
            or ".ln" in name or "norm" in name)


def build_optimizer(model: torch.nn.Module, args) -> torch.optim.Optimizer:
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if args.exclude_decay and is_no_decay(name, param) else decay).append(param)
    groups = [{"params": decay, "weight_decay": args.weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    if args.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=args.lr, momentum=args.beta1)
    # fused: one kernel over all parameters instead of ~10 small ops per tensor (the same
    # update up to rounding). The original's AdamW is the plain one.
    fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point()
                for group in groups for p in group["params"])
    return torch.optim.AdamW(groups, lr=args.lr, betas=(args.beta1, args.beta2), fused=fused)


def lock_towers(model: torch.nn.Module, args, log) -> None:
    for flag, tower in ((args.lock_image, "image_model"), (args.lock_text, "text_model")):
        if flag:
            for p in getattr(model, tower).parameters():
                p.requires_grad_(False)
            log.info(f"{tower} locked (frozen)")


def add_lora_adapters(model: torch.nn.Module, args, log) -> None:
    """``--lora-rank``: adapters in the towers that are not locked (:mod:`rwkv_clip.lora`)."""
    settings = LoraSettings.from_args(args)
    if settings is None:
        return
    towers = tuple(t for t, locked in (("image_model", args.lock_image),
                                       ("text_model", args.lock_text)) if not locked)
    names = add_adapters(model, settings, towers)
    log.info(f"{settings.describe()}: {len(names)} adapted layers in {', '.join(towers)}; "
             "every other weight frozen")


def loader_args(args, info: DistInfo, train_data: str, data_format: str) -> LoaderArgs:
    from ..data.loader import LoaderArgs

    return LoaderArgs(
        train_data=train_data, data_format=data_format, batch_size=args.batch_size,
        workers=args.workers, input_size=args.input_size, seed=args.seed,
        skip_corrupt=args.skip_corrupt, device=str(info.device), rank=info.rank,
        local_rank=info.local_rank, world_size=info.world_size, loader=args.loader,
        image_column=args.image_column, caption_columns=args.caption_columns,
        caption_tokens=args.caption_tokens, ctx_len=int(args.model_config.get("ctx_len", 77)))


def set_loader_epoch(loader, epoch: int) -> None:
    """Put a fresh loader at ``epoch`` (its shuffle and augmentation draws)."""
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(epoch)
    elif hasattr(loader, "epoch"):
        loader.epoch = epoch
    else:
        for _ in range(epoch):
            loader.reset()


def out_of_memory_message(exc: BaseException, args) -> str:
    return (f"out of memory during training ({type(exc).__name__}: {str(exc).splitlines()[0]}). "
            f"Try --open-checkpoint True (activation checkpointing in both towers), or a smaller "
            f"--batch-size with --gradient-acc K (K x batch-size keeps the effective batch; "
            f"now --batch-size {args.batch_size} --gradient-acc {args.gradient_acc}), "
            f"or --precision bf16.")


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower())


def cli(argv=None) -> int:
    """``train.py``: parse, train; a user error is one line ``train.py: error: ...`` and
    exit status 2 (argparse's own errors exit 2 as well)."""
    from .args import parse_args

    def run() -> int:
        args = parse_args(argv)
        check_wkv_environment()  # a mistyped kernel name stops here, before any set-up
        # the process is ours: on the CPU it keeps freed memory for the next step's reuse
        host_memory.configure_host_malloc(pick_device(args.device, launch_environment()[2]),
                                          args.host_malloc)
        main(args)  # the summary dict is for library callers
        return 0

    try:
        return run_cli(run, prog="train.py")
    except Interrupted as exc:  # the checkpoint is written and the line printed
        return exc.exit_code
