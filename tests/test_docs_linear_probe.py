"""Every command of docs/linear-probe-and-validation.md parses with its script's real parser
(the flags and values exist and pass their checks); the tiny runs of test_linear_probe.py and
test_train_validation.py run the same flags end to end."""
import re
import shlex
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[1] / "docs" / "linear-probe-and-validation.md"


def _commands() -> list[str]:
    blocks = re.findall(r"^```bash\n(.*?)^```", PAGE.read_text(), flags=re.S | re.M)
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def test_the_page_shows_commands_of_the_three_features():
    text = " ".join(_commands())
    for flag in ("--task linear_probe", "--fewshot-k", "--val-data", "--val-frequency",
                 "--report-to tensorboard,wandb", "--wandb-project-name", "--name"):
        assert flag in text


@pytest.mark.parametrize("command", _commands())
def test_documented_command_parses(command, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    words = shlex.split(command)
    env = {}
    while "=" in words[0]:
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert words[0] == "python"
    script, argv = words[1], words[2:]
    if script == "zero_shot.py":
        from rwkv_clip.eval.cli import parse_options

        opts = parse_options(argv)
        assert opts.task == "linear_probe"
    elif script == "train.py":
        from rwkv_clip.train import parse_args

        args = parse_args(argv)
        if "--name" in argv:
            assert args.name == argv[argv.index("--name") + 1]
            assert args.output == str(Path("runs") / args.name)
        if "--report-to" in argv:
            assert args.report_to == argv[argv.index("--report-to") + 1].split(",")
    else:
        pytest.fail(f"unexpected command {command!r}")
