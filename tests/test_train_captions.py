"""--caption-weights: which of the three captions (raw, synthetic, generated) a sample
trains on; the draw is fixed by (seed, rank, epoch, step) as the uniform one."""
import pytest
import torch

from rwkv_clip.train import parse_args
from rwkv_clip.train.accumulation import caption_generator, choose_captions

N = 20000


def _tokens(n=N):
    """Caption variant v of every sample starts with token 100 + v."""
    tokens = torch.zeros(n, 231, dtype=torch.long)
    for v in range(3):
        tokens[:, v * 77] = 100 + v
    return tokens


def _variants(weights, n=N, seed=0, step=0):
    chosen = choose_captions(_tokens(n), caption_generator(seed, 0, 0, step), weights)
    return chosen[:, 0] - 100


def test_one_nonzero_weight_gives_only_that_caption():
    for v, weights in enumerate(([1, 0, 0], [0, 1, 0], [0, 0, 2.5])):
        assert torch.equal(_variants(weights), torch.full((N,), v)), weights


def test_draws_follow_the_weights():
    counts = torch.bincount(_variants([3, 1, 0]), minlength=3).double() / N
    # binomial standard deviation at N = 20000 is about 0.003
    assert counts[0] == pytest.approx(0.75, abs=0.015)
    assert counts[1] == pytest.approx(0.25, abs=0.015)
    assert counts[2] == 0
    counts = torch.bincount(_variants([0.2, 0.3, 0.5]), minlength=3).double() / N
    assert counts.tolist() == pytest.approx([0.2, 0.3, 0.5], abs=0.015)


def test_equal_weights_are_the_uniform_draw():
    """1,1,1 (the default) and any equal weights draw exactly what the uniform choice
    draws, so runs keep their captions whatever equal weights they name."""
    uniform = torch.randint(0, 3, (N,), generator=caption_generator(0, 0, 0, 0))
    for weights in (None, [1, 1, 1], [0.5, 0.5, 0.5]):
        assert torch.equal(_variants(weights), uniform), weights
    counts = torch.bincount(uniform, minlength=3).double() / N
    assert counts.tolist() == pytest.approx([1 / 3] * 3, abs=0.015)


def test_the_draw_is_fixed_by_seed_and_step():
    """What a resume relies on: the same (seed, rank, epoch, step) draws the same captions,
    another step or seed other ones."""
    weights = [0.2, 0.3, 0.5]
    first = _variants(weights, n=64, seed=7, step=3)
    assert torch.equal(first, _variants(weights, n=64, seed=7, step=3))
    assert not torch.equal(first, _variants(weights, n=64, seed=7, step=4))
    assert not torch.equal(first, _variants(weights, n=64, seed=8, step=3))


def test_single_caption_tokens_pass_through():
    tokens = torch.arange(2 * 77).view(2, 77)
    assert torch.equal(choose_captions(tokens, None, [0, 0, 1]), tokens)


def test_flag_parses_and_records():
    assert parse_args([]).caption_weights == [1.0, 1.0, 1.0]
    assert parse_args(["--caption-weights", "1,0,0"]).caption_weights == [1.0, 0.0, 0.0]
    assert parse_args(["--caption-weights", "0.2, 0.3,0.5"]).caption_weights == [0.2, 0.3, 0.5]


@pytest.mark.parametrize("value", ["1,0", "0,0,0", "1,-1,1", "a,b,c", "1,1,1,1", "nan,1,1",
                                   "inf,1,1", ""])
def test_bad_weights_are_one_line_and_exit_2(value, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--caption-weights", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert err.startswith("train.py: error: argument --caption-weights: expected three "
                          "non-negative numbers RAW,SYN,GEN"), err
    assert repr(value) in err
