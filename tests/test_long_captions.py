"""Captions of any length: tokenising at any context length, every data path storing and
reading k x ctx_len tokens (the original's k x 77 fitted to it), the one-line error where
stored tokens and --ctx-len disagree, and a 77-token model run at other lengths."""
import io
import json
import os
from types import SimpleNamespace as NS

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from train_util import TINY_CONFIG, tiny_argv, tiny_model

from rwkv_clip import tokenize
from rwkv_clip.data import build_train_loader, convert, normalize_labels
from rwkv_clip.data.tokens import CaptionTokens, tokens_from_row
from rwkv_clip.errors import DataError, DatasetNotFoundError, TrainArgsError
from rwkv_clip.tokenizer import EOT_TOKEN, SOT_TOKEN, fit_context_length

N = 8
COLOURS = ["red", "green", "blue", "yellow", "purple", "orange", "white", "black"]


def long_caption(i: int) -> str:
    """About 130 tokens; sample i's colour word is said first and last."""
    c = COLOURS[i % len(COLOURS)]
    middle = ", ".join(f"a small {COLOURS[(i + k) % 8]} shape number {k} near the edge"
                       for k in range(12))
    return f"a {c} scene with {middle}, and at the very end a {c} square"


def png(i: int) -> bytes:
    b = io.BytesIO()
    Image.fromarray(np.full((20, 20, 3), 20 + 25 * i, np.uint8)).save(b, format="PNG")
    return b.getvalue()


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("long")
    with open(root / "pairs.jsonl", "w") as f:
        for i in range(N):
            (root / f"{i}.png").write_bytes(png(i))
            f.write(json.dumps({"image": f"{i}.png", "raw": long_caption(i)}) + "\n")
    return root


def loader_args(data, fmt, ctx_len, **kw):
    a = dict(train_data=str(data), data_format=fmt, batch_size=4, workers=0, input_size=16,
             seed=0, device="cpu", loader="torch", ctx_len=ctx_len)
    a.update(kw)
    return NS(**a)


def rows_of(loader) -> set:
    return {tuple(t.tolist()) for _, toks in loader for t in toks}


def expected_rows(ctx_len: int) -> set:
    toks = tokenize([long_caption(i) for i in range(N)], context_length=ctx_len)
    return {tuple(t.tolist()) * 3 for t in toks}


# ----------------------------------------------------------------------------- tokenizer

@pytest.mark.parametrize("n", [1, 2, 3, 77, 100, 300])
def test_tokenize_any_length_keeps_end_of_text(n):
    toks = tokenize([long_caption(0), "a cat"], context_length=n)
    assert toks.shape == (2, n)
    full = tokenize([long_caption(0)], context_length=400)[0]
    length = int(full.ne(0).sum())
    assert 100 < length < 200
    if n < length:
        assert toks[0, -1] == EOT_TOKEN  # cut: the last kept token is end-of-text
    else:
        assert toks[0, length - 1] == EOT_TOKEN and not toks[0, length:].any()
    if n == 1:
        assert toks.tolist() == [[EOT_TOKEN], [EOT_TOKEN]]
    else:
        assert (toks[:, 0] == SOT_TOKEN).all()
    assert torch.equal(fit_context_length(full[None], n)[0], toks[0])  # stored -> same ids


def test_stored_rows_fit_the_context_length():
    full = tokenize([long_caption(1)], context_length=100)[0].numpy()
    short = tokenize([long_caption(1)], context_length=77)[0].numpy()
    # 3 x ctx_len kept; 2 captions repeat the second; the original's 3 x 77 fitted
    assert np.array_equal(normalize_labels(np.tile(full, 3), ctx_len=100), np.tile(full, 3))
    two = np.concatenate([full, full[::-1]])
    assert np.array_equal(normalize_labels(two, ctx_len=100),
                          np.concatenate([full, full[::-1], full[::-1]]))
    padded = normalize_labels(np.tile(short, 3), ctx_len=100).reshape(3, 100)
    assert np.array_equal(padded[:, :77], np.tile(short, (3, 1))) and not padded[:, 77:].any()
    cut = normalize_labels(np.tile(short, 3), ctx_len=20).reshape(3, 20)
    assert np.array_equal(cut[0], tokenize([long_caption(1)], context_length=20)[0].numpy())
    assert np.array_equal(tokens_from_row(full, ctx_len=100), np.tile(full, 3))  # k = 1
    with pytest.raises(DataError, match=r"record has 300 labels; expected 3/2 captions x 77 "):
        normalize_labels(np.tile(full, 3))
    with pytest.raises(DataError, match=r"token row has 90 values; expected 3/2/1 captions x "
                                        r"50 tokens \(--ctx-len 50\) or x 77"):
        tokens_from_row(np.zeros(90), ctx_len=50)


# ----------------------------------------------------------------------------- data paths

@pytest.mark.parametrize("fmt", ["rec", "wds"])
def test_rec_and_wds_store_and_read_long_captions(pairs, tmp_path, fmt):
    out = str(tmp_path / "long")
    convert(str(pairs / "pairs.jsonl"), out, fmt=fmt, progress=False, context_length=100)
    data = out if fmt == "rec" else out + "-000000.tar"
    got = rows_of(build_train_loader(loader_args(data, fmt, 100), log=None))
    assert got <= expected_rows(100) and len(got) >= N - 3  # full batches of a shuffle
    assert all(any(v != 0 for v in row[80:100]) for row in got)  # tokens past 77 kept
    with pytest.raises(DataError, match=r"300 labels; expected 3/2 captions x 77 tokens"
                       if fmt == "rec" else r"'tok' holds 1200 bytes; expected int32"):
        build_train_loader(loader_args(data, fmt, 77), log=None)


def test_original_77_token_data_at_any_context_length(pairs, tmp_path):
    out = str(tmp_path / "short")
    convert(str(pairs / "pairs.jsonl"), out, fmt="rec", progress=False)  # 3 x 77
    for n in (20, 77, 150):
        got = rows_of(build_train_loader(loader_args(out, "rec", n), log=None))
        want = {tuple(fit_context_length(torch.tensor(r).view(3, 77), n).view(-1).tolist())
                for r in expected_rows(77)}
        assert got <= want and len(got) >= N - 3


def test_parquet_text_and_token_columns_at_long_context(tmp_path):
    caps = [long_caption(i) for i in range(N)]
    toks = tokenize(caps, context_length=120).numpy()
    pq.write_table(pa.table({"jpg": [png(i) for i in range(N)], "caption": caps,
                             "tok": [t.tolist() for t in toks]}), tmp_path / "a.parquet")
    path = str(tmp_path / "a.parquet")
    text = rows_of(build_train_loader(loader_args(path, "parquet", 120,
                                                  caption_columns="caption"), log=None))
    assert text <= expected_rows(120) and len(text) == N
    stored = rows_of(build_train_loader(loader_args(path, "parquet", 120,
                                                    caption_columns="tok"), log=None))
    assert stored == text
    with pytest.raises(DataError, match="token row has 120 values; expected 3/2/1 captions x "
                                        "77 tokens"):
        rows_of(build_train_loader(loader_args(path, "parquet", 77, caption_columns="tok"),
                                   log=None))


def test_caption_token_arrays_of_n_by_k(pairs, tmp_path):
    out = str(tmp_path / "short")
    convert(str(pairs / "pairs.jsonl"), out, fmt="rec", progress=False)
    caps = [long_caption(i) for i in range(N)]
    toks = tokenize(caps, context_length=100).numpy()
    own = fit_context_length(tokenize(caps, context_length=77), 100).numpy()  # the .rec's
    for k in (1, 2, 3):  # the array's k captions replace the first k variants
        np.save(tmp_path / f"k{k}.npy", np.tile(toks, k))
        got = rows_of(build_train_loader(loader_args(
            out, "rec", 100, caption_tokens=str(tmp_path / f"k{k}.npy")), log=None))
        want = {tuple(np.concatenate([np.tile(t, k), np.tile(o, 3 - k)]).tolist())
                for t, o in zip(toks, own, strict=True)}
        assert got <= want and len(got) >= N - 3
    with pytest.raises(DataError, match=r"rows of 100 tokens; expected \(N, L x k\) with k = "
                                        r"1, 2 or 3 captions of L = 120 tokens \(--ctx-len\) "
                                        r"or 77"):
        CaptionTokens(str(tmp_path / "k1.npy"), ctx_len=120)
    with pytest.raises(TrainArgsError, match="--loader dali reads 3 x 77"):
        build_train_loader(loader_args(out, "rec", 100, loader="dali"), log=None)


# ----------------------------------------------------------------------------- train / eval

def test_train_at_long_context_records_it_and_disagreement_is_one_line(pairs, tmp_path,
                                                                        capsys):
    from rwkv_clip.train import cli, main, parse_args
    data = str(tmp_path / "long")
    convert(str(pairs / "pairs.jsonl"), data, fmt="rec", progress=False, context_length=100)
    out = tmp_path / "run"
    main(parse_args(tiny_argv(out, data, "--ctx-len", "100", "--batch-size", "4")))
    ckpt = torch.load(next((out / "checkpoints").glob("*.pt")), map_location="cpu",
                      weights_only=False)
    assert ckpt["model_config"]["ctx_len"] == 100
    rc = cli(tiny_argv(tmp_path / "bad", data, "--batch-size", "4"))  # 77 against 3 x 100
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[0].startswith("train.py: error: record has 300 labels; expected "
                                         "3/2 captions x 77 tokens"), err


def test_a_77_token_model_runs_at_any_length():
    from rwkv_clip import load_model_configs
    from rwkv_clip.checkpoint_files import StateDict
    from rwkv_clip.factory import build_model
    short = tiny_model()
    state = StateDict(dict(short.state_dict()), "tiny")
    for n in (1, 248):
        args = load_model_configs(TINY_CONFIG)
        args.ctx_len = n
        model = build_model(args, state).eval()
        with torch.no_grad():
            f = model.encode_text(tokenize([long_caption(0), "a cat"], context_length=n))
        assert f.shape == (2, 64) and torch.isfinite(f).all()
    with torch.no_grad():  # same weights, same text: the 77-token reading is unchanged
        a = short.eval().encode_text(tokenize(["a cat"], context_length=77))
        b = build_model(load_model_configs(TINY_CONFIG), state).eval().encode_text(
            tokenize(["a cat"], context_length=77))
    assert torch.equal(a, b)


def test_retrieval_cli_reads_long_captions_with_a_77_token_checkpoint(pairs, tmp_path, capsys):
    from text_image_retrieval import main
    weights = tmp_path / "tiny77.pt"
    torch.save(tiny_model().state_dict(), weights)
    with open(tmp_path / "long.jsonl", "w") as f:
        for i in range(N):
            f.write(json.dumps({"image": str(pairs / f"{i}.png"),
                                "captions": [long_caption(i)]}) + "\n")
    for n in (77, 248):
        rc = main(["--model-weight", str(weights), "--ctx-len", str(n), "--retrieval-file",
                   str(tmp_path / "long.jsonl"), "--workers", "0", "--device", "cpu",
                   "--output-dir", str(tmp_path / f"out{n}")])
        assert rc == 0, capsys.readouterr().err
        out = next((tmp_path / f"out{n}").glob("*_zeroshot_retrieval.json"))
        record = json.loads(out.read_text())
        assert record["num_texts"] == N and record["metrics"]["text_retrieval_recall@10"] == 1.0


# ----------------------------------------------------------------------------- users' sets

def urban1k(root, n=N):
    (root / "image").mkdir(parents=True)
    (root / "caption").mkdir()
    for i in range(n):
        (root / "image" / f"{i}.jpg").write_bytes(png(i))  # PIL reads by content
        (root / "caption" / f"{i}.txt").write_text(long_caption(i) + "\n")
    return root


def test_urban1k_and_sharegpt4v_layouts_load(pairs, tmp_path):
    from rwkv_clip.errors import EvalError
    from rwkv_clip.eval.retrieval import build_retrieval_set
    root = urban1k(tmp_path / "data" / "Urban1k")
    for where in (root, tmp_path / "data"):  # the set's folder, or a root holding Urban1k/
        rset = build_retrieval_set("urban1k", where)
        assert rset.captions == [long_caption(i) for i in range(N)]
        assert [os.path.basename(p) for p in rset.image_paths] == [f"{i}.jpg" for i in range(N)]
        assert rset.text_to_image == list(range(N))
    (root / "caption" / "3.txt").unlink()
    with pytest.raises(EvalError, match=r"1 file\(s\) without their pair, e.g. '3' has no "
                                        r"caption file"):
        build_retrieval_set("urban1k", root)
    with pytest.raises(DatasetNotFoundError, match=r"Expected layout:\n.*image/NAME.jpg"):
        build_retrieval_set("urban1k", tmp_path)
    share = [{"id": str(i), "image": f"{i}.png", "conversations": [
        {"from": "human", "value": "<image>\nDescribe the picture in detail."},
        {"from": "gpt", "value": long_caption(i)}]} for i in range(N)]
    (pairs / "share.json").write_text(json.dumps(share))
    rset = build_retrieval_set("sharegpt4v", retrieval_file=pairs / "share.json")
    assert rset.captions == [long_caption(i) for i in range(N)] and rset.num_images == N
    dci = [{"image": f"{i}.png", "caption": long_caption(i)} for i in range(N)]
    (pairs / "dci.json").write_text(json.dumps(dci))
    assert build_retrieval_set("dci", retrieval_file=pairs / "dci.json").captions == rset.captions
    share[2]["conversations"] = share[2]["conversations"][:1]
    (pairs / "bad.json").write_text(json.dumps(share))
    with pytest.raises(EvalError, match=r"entry 2: 'conversations' holds no answer"):
        build_retrieval_set("sharegpt4v", retrieval_file=pairs / "bad.json")


def test_retrieval_cli_on_urban1k_layout(tmp_path, capsys):
    from text_image_retrieval import main
    root = urban1k(tmp_path / "Urban1k")
    rc = main(["--config", "RWKV_CLIP_tiny", "--dataset", "urban1k", "--data-root", str(root),
               "--ctx-len", "248", "--workers", "0", "--device", "cpu",
               "--output-dir", str(tmp_path / "out")])
    assert rc == 0, capsys.readouterr().err
    record = json.loads((tmp_path / "out" / "urban1k_zeroshot_retrieval.json").read_text())
    assert record["num_images"] == N and record["num_texts"] == N


# ----------------------------------------------------------------------------- built-in split

def test_builtin_long_split_differs_only_past_token_77(tmp_path):
    from rwkv_clip.data.builtin_long import (
        GROUP,
        Scene,
        background_position,
        ensure_long_caption_dataset,
    )
    from rwkv_clip.eval.long_captions import evaluate_groups, read_group_file
    ds = ensure_long_caption_dataset(str(tmp_path), num_train=8, num_groups=3)
    entries = read_group_file(ds.eval_file)
    assert len(entries) == 3 * GROUP
    toks = tokenize([e["caption"] for e in entries], context_length=128)
    lengths = toks.ne(0).sum(1)
    assert lengths.min() >= 60 and lengths.max() <= 128 and lengths.max() > 77
    short = fit_context_length(toks, 77)
    for g in range(3):
        rows = [i for i, e in enumerate(entries) if e["group"] == g]
        assert len({tuple(short[i].tolist()) for i in rows}) == 1  # one text at 77 tokens
        assert len({tuple(toks[i].tolist()) for i in rows}) == GROUP  # all differ in full
    assert background_position(Scene([None] * 9, "grey")) >= 77  # the shortest caption
    loader = build_train_loader(loader_args(ds.train_prefix, "rec", 128), log=None)
    assert next(iter(loader))[1].shape == (4, 3 * 128)
    torch.manual_seed(0)
    scores = evaluate_groups(tiny_model(ctx_len=128).eval(), entries, (None, 77))
    cut = scores["77 tokens"]
    assert cut["image_to_text_R@1"] == pytest.approx(1 / GROUP)  # ties: chance exactly
    assert cut["text_to_image_R@1"] == pytest.approx(1 / GROUP)
    assert cut["chance"] == pytest.approx(1 / GROUP)


def test_tied_recall_at_1():
    from rwkv_clip.eval.long_captions import group_recall, tied_recall_at_1
    scores = torch.tensor([[0.9, 0.1, 0.9], [0.2, 0.8, 0.1], [0.5, 0.5, 0.5]])
    got = tied_recall_at_1(scores, torch.tensor([0, 0, 2]))
    assert got.tolist() == pytest.approx([0.5, 0.0, 1 / 3])
    feats = torch.eye(4)
    r = group_recall(feats, feats, [0, 0, 1, 1])
    assert r == {"image_to_text_R@1": 1.0, "text_to_image_R@1": 1.0, "chance": 0.5}


# ----------------------------------------------------------------------------- cost benchmark

def test_stretched_positional_embedding():
    from rwkv_clip.bench.text_length import stretch_positional_embedding
    pos = torch.arange(77.0)[:, None].repeat(1, 3)
    out = stretch_positional_embedding(pos, 248)
    assert out.shape == (248, 3)
    assert torch.equal(out[:20], pos[:20]) and out[-1, 0] == 76 and out[20, 0] == 20
    assert (out[21:, 0] - out[20:-1, 0] > 0).all()  # interpolated, in order
    assert torch.equal(stretch_positional_embedding(pos, 12), pos[:12])


def test_bench_text_length_pairs_both_towers(tmp_path, capsys):
    import argparse

    from rwkv_clip.bench.text_length import add_flags, main
    ap = argparse.ArgumentParser()
    add_flags(ap)
    argv = ["--lengths", "8,24", "--tasks", "train", "--batch", "1", "--repeats", "2",
            "--config", "RWKV_CLIP_tiny", "--output", str(tmp_path / "t.json")]
    assert main(ap.parse_args(argv), argv) == 0
    doc = json.loads((tmp_path / "t.json").read_text())
    assert [(c["task"], c["length"]) for c in doc["cases"]] == [("train", 8), ("train", 24)]
    for c in doc["cases"]:
        for name in ("rwkv_clip", "open_clip"):
            assert c[name]["finite"] and len(c[name]["step_s"]) == 2
            assert c[name]["peak_bytes"] > 0
        assert c["ratio"] > 0
    assert set(doc["slopes"]) == {"train"} and doc["slopes"]["train"]["open_clip"]["time"]


@pytest.mark.parametrize("mode", [["--lora-rank", "4"], ["--lock-image"]])
def test_fine_tune_a_77_token_checkpoint_on_long_captions(pairs, tmp_path, mode):
    from rwkv_clip.eval.zeroshot import evaluate_imagefolder
    from rwkv_clip.train import main, parse_args
    folder = tmp_path / "zs"  # the short-caption zero-shot set: one class per grey level
    for i in range(2):
        (folder / f"level{i}").mkdir(parents=True)
        (folder / f"level{i}" / "a.png").write_bytes(png(3 * i))
    short = tiny_model()
    weights = tmp_path / "tiny77.pt"
    torch.save(short.state_dict(), weights)
    before = evaluate_imagefolder(short, folder)["acc1"]
    data = str(tmp_path / "long")
    convert(str(pairs / "pairs.jsonl"), data, fmt="rec", progress=False, context_length=128)
    summary = main(parse_args(tiny_argv(
        tmp_path / "run", data, "--pretrained", str(weights), "--ctx-len", "128",
        "--batch-size", "4", "--max-steps", "1", "--zero-shot-data", str(folder),
        "--final-zero-shot", "True", *mode)))
    after = summary["zero_shot"]["acc1"]
    assert 0.0 <= before <= 1.0 and 0.0 <= after <= 1.0
    assert summary["model"].text_model.args.ctx_len == 128 and summary["steps"] == 1


@pytest.mark.parametrize("lr", ["0", "-1e-3", "nan"])
def test_long_captions_script_rejects_a_bad_lr_before_any_work(tmp_path, lr):
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parents[1] / "scripts" / "long_captions.py"
    out = subprocess.run([sys.executable, str(script), f"--lr={lr}", "--data-root",
                          str(tmp_path / "data")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        f"long_captions.py: error: --lr must be > 0, got {float(lr)}"], out.stderr
    assert not (tmp_path / "data").exists()  # failed before generating the split
