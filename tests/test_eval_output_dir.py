"""zero_shot.py writes its results beside the evaluated run, never into the current folder."""
from pathlib import Path

from rwkv_clip.eval.runner import DEFAULT_SCORE_FILE, options, output_paths


def test_results_go_beside_the_checkpoints_run(tmp_path):
    weight = tmp_path / "runs" / "b32" / "checkpoints" / "epoch_latest.pt"
    json_dir, score = output_paths(options(model_weight=str(weight)))
    assert json_dir == tmp_path / "runs" / "b32" / "eval_results"
    assert score == json_dir / DEFAULT_SCORE_FILE
    # the parser's default name means "not given" as well
    assert output_paths(options(model_weight=str(weight), output_dir="eval_results"))[0] \
        == json_dir


def test_weights_elsewhere_and_a_fresh_model(tmp_path):
    weight = tmp_path / "downloads" / "RWKV_CLIP_B32.pt"
    assert output_paths(options(pretrained=str(weight)))[0] == (
        tmp_path / "downloads" / "eval_results")
    assert output_paths(options())[0] == Path("runs") / "zero_shot" / "eval_results"


def test_an_explicit_output_dir_wins(tmp_path):
    weight = tmp_path / "runs" / "x" / "checkpoints" / "epoch_1.pt"
    assert output_paths(options(model_weight=str(weight), output_dir=str(tmp_path / "r")))[0] \
        == tmp_path / "r"
    json_dir, score = output_paths(options(output_dir=str(tmp_path / "scores.txt")))
    assert (json_dir, score) == (tmp_path, tmp_path / "scores.txt")


def test_a_second_result_keeps_the_first(tmp_path):
    """A rerun writes the canonical name; the earlier file is kept as NAME.1.json, then
    NAME.2.json, never overwritten."""
    import json

    from rwkv_clip.eval.results import result_record, write_result

    def record(acc):
        return result_record("builtin", "m", "w.pt", "zeroshot_classification",
                             {"acc1": acc, "acc5": 1.0, "mean_per_class_recall": acc})

    first = write_result(record(0.1), tmp_path)
    assert write_result(record(0.2), tmp_path) == first
    write_result(record(0.3), tmp_path)
    acc = {p.name: json.loads(p.read_text())["metrics"]["acc1"] for p in tmp_path.iterdir()}
    assert acc == {"builtin_zeroshot_classification.json": 0.3,
                   "builtin_zeroshot_classification.1.json": 0.1,
                   "builtin_zeroshot_classification.2.json": 0.2}
