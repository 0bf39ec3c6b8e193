"""The training loop's end of run: zero-shot during training and at the end."""
import numpy as np
import pytest
from PIL import Image
from train_util import COLOURS, make_tiny_rec, tiny_argv

from rwkv_clip.train import main, parse_args


def _colour_folder(root, per_class=2):
    for name, colour in COLOURS.items():
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(np.full((20, 20, 3), colour, np.uint8)).save(root / name / f"{i}.png")
    return root


@pytest.mark.slow
def test_final_zero_shot_is_not_a_repeat_of_the_last_epochs(tmp_path):
    data = make_tiny_rec(tmp_path / "data", n=16)
    folder = _colour_folder(tmp_path / "zs")
    out = tmp_path / "run"
    result = main(parse_args(tiny_argv(out, data, "--zero-shot-data", str(folder),
                                       "--zero-shot-every", "1", "--final-zero-shot", "True")))
    log = (out / "training.log").read_text()
    assert log.count("zero-shot (epoch 1)") == 1 and "zero-shot (final)" not in log
    history = result["zero_shot_history"]
    assert [h["epoch"] for h in history] == [1]
    assert result["zero_shot"]["acc1"] == history[0]["acc1"]
    assert "final zero-shot accuracy: top-1" in log
