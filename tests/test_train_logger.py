"""The training progress line (plain and original formats) and the kernel notice."""
import logging
import re

import pytest
import torch

from rwkv_clip.train.logger import (
    SpeedLogger,
    close_logging,
    format_duration,
    format_lr,
    setup_logging,
)


def test_format_lr_and_duration():
    assert format_lr(4.5e-4) == "4.5e-4"
    assert format_lr(1e-3) == "1e-3"
    assert format_lr(0.0) == "0"
    assert format_lr(3e-3) == "3e-3"
    assert format_duration(190) == "3:10"
    assert format_duration(59.6) == "1:00"
    assert format_duration(3 * 3600 + 62) == "3:01:02"
    assert format_duration(-5) == "0:00"


def _feed(logger, steps, loss=2.0, samples=64):
    lines = []
    for step in steps:
        line = logger.update(step=step, loss=loss + step / 100, samples=samples, lr=4.5e-4,
                             amp_scale=1.0)
        if line:
            lines.append((step, line))
    return lines


def test_plain_line_names_epoch_step_loss_lr_speed_eta():
    logger = SpeedLogger(5, 441, world_size=2, steps_per_epoch=63)
    lines = _feed(logger, range(1, 11))
    assert [s for s, _ in lines] == [5, 10]
    step, line = lines[-1]
    m = re.fullmatch(r"epoch 1/7 step 10/441 loss (\S+) lr 4\.5e-4 (\d+) pairs/s "
                     r"eta (\d+):(\d\d)", line)
    assert m, line
    # loss: the mean of steps 6..10 only (reset after each line)
    assert float(m.group(1)) == pytest.approx(2.0 + 8 / 100, abs=1e-3)
    # epoch boundaries: step 63 is the last of epoch 1, step 64 the first of epoch 2
    logger = SpeedLogger(1, 441, 1, steps_per_epoch=63)
    assert logger.update(step=63, loss=1, samples=1, lr=1e-3, amp_scale=1).startswith(
        "epoch 1/7 step 63/441")
    assert logger.update(step=64, loss=1, samples=1, lr=1e-3, amp_scale=1).startswith(
        "epoch 2/7 step 64/441")


def test_last_step_always_logged_and_original_format():
    logger = SpeedLogger(5, 7, world_size=1, fmt="original")
    lines = _feed(logger, range(1, 8))
    assert [s for s, _ in lines] == [5, 7]
    assert re.fullmatch(r"rank:\d+ total:\d+ lr:\[0\.00045000\] step:7 amp:1 "
                        r"required:0\.0 hours \[2\.065\]", lines[-1][1]), lines[-1][1]


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="log format 'json'"):
        SpeedLogger(5, 10, 1, fmt="json")


def test_log_file_prefixes(tmp_path):
    for fmt, pattern in (("plain", r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d hello"),
                         ("original", r"Training: \d{4}-\d\d-\d\d [\d:,]+-hello")):
        out = tmp_path / fmt
        log = setup_logging(str(out), 0, fmt)
        log.info("hello")
        close_logging()
        assert re.fullmatch(pattern, (out / "training.log").read_text().strip()), fmt


class _Recorder(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_kernel_notice_only_when_the_cpu_kernel_is_not_cached(tmp_path, monkeypatch):
    from rwkv_clip.ops import build, dispatch, prepare_wkv_kernel

    log = logging.getLogger("test_kernel_notice")
    rec = _Recorder()
    log.addHandler(rec)
    log.setLevel(logging.INFO)
    prepare_wkv_kernel(torch.device("meta"), log.info)  # not a CPU run: nothing to do
    monkeypatch.setenv("RWKV_CLIP_DISPATCH", "wkv=reference")
    dispatch.reset()
    prepare_wkv_kernel(torch.device("cpu"), log.info)  # pure-PyTorch reference: no kernel
    assert rec.messages == []
    monkeypatch.delenv("RWKV_CLIP_DISPATCH")
    dispatch.reset()
    if not build.cpu_kernel_cached():
        pytest.skip("the CPU kernel is not built in this cache (the notice would compile it)")
    prepare_wkv_kernel(torch.device("cpu"), log.info)
    assert rec.messages == []  # cached: silent


@pytest.mark.slow
def test_kernel_notice_before_a_first_build(tmp_path, monkeypatch):
    from rwkv_clip.ops import build, prepare_wkv_kernel

    monkeypatch.setenv("RWKV_CLIP_CACHE", str(tmp_path))
    monkeypatch.setattr(build, "_loaded", {})
    log = logging.getLogger("test_kernel_notice_slow")
    rec = _Recorder()
    log.addHandler(rec)
    log.setLevel(logging.INFO)
    prepare_wkv_kernel(torch.device("cpu"), log.info)
    assert rec.messages[0].startswith("preparing the WKV CPU kernel (first use compiles it")
    assert rec.messages[1].startswith("WKV CPU kernel ready")
    assert build.cpu_kernel_cached()
    rec.messages.clear()
    prepare_wkv_kernel(torch.device("cpu"), log.info)  # cached now: no notice
    assert rec.messages == []
