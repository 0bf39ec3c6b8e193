"""Evaluation metrics against values computed by hand on tiny tensors."""
import math

import pytest
import torch

from rwkv_clip.eval.distributed import shard_range
from rwkv_clip.eval.metrics import (
    classification_metrics,
    headline_metric_name,
    mean_per_class_recall,
    per_class_recall,
    recall_at_k,
    retrieval_metrics,
    retrieval_metrics_from_scores,
)
from rwkv_clip.eval.results import result_record, score_line, summary, validate_record

# 5 samples, 6 classes. By hand:
#   row 0: target 1, argmax 5 (wrong), rank of target 2     -> top1 no, top5 yes
#   row 1: target 0, argmax 0                                -> top1 yes
#   row 2: target 0, ranking 5,4,3,2,1,0 (target last)       -> top1 no, top5 no
#   row 3: target 3, argmax 3                                -> top1 yes
#   row 4: target 3, argmax 3                                -> top1 yes
# acc1 = 3/5, acc5 = 4/5; recall class0 = 1/2, class1 = 0/1, class3 = 2/2 -> mean 1/2
LOGITS = torch.tensor([
    [0.1, 0.5, 0.2, 0.0, 0.3, 0.9],
    [0.9, 0.1, 0.2, 0.3, 0.4, 0.5],
    [0.0, 0.1, 0.2, 0.3, 0.4, 0.5],
    [0.2, 0.1, 0.0, 0.9, 0.3, 0.4],
    [0.0, 0.0, 0.1, 1.0, 0.2, 0.3],
])
TARGETS = torch.tensor([1, 0, 0, 3, 3])


def test_classification_metrics_by_hand():
    m = classification_metrics(LOGITS, TARGETS, 6)
    assert m["acc1"] == pytest.approx(3 / 5)
    assert m["acc5"] == pytest.approx(4 / 5)
    assert m["mean_per_class_recall"] == pytest.approx(0.5)


def test_per_class_recall_skips_absent_classes():
    recall = per_class_recall(LOGITS.argmax(1), TARGETS, 6)
    assert recall[0].item() == pytest.approx(0.5)
    assert recall[1].item() == 0.0
    assert recall[3].item() == 1.0
    assert all(math.isnan(recall[i].item()) for i in (2, 4, 5))
    # balanced accuracy: 2 classes, one perfect (4 samples), one always wrong (1 sample)
    preds = torch.tensor([0, 0, 0, 0, 0])
    targets = torch.tensor([0, 0, 0, 0, 1])
    assert mean_per_class_recall(preds, targets, 2) == pytest.approx(0.5)
    assert classification_metrics(torch.tensor([[1.0, 0.0]] * 5), targets)["acc1"] == pytest.approx(0.8)


def test_float_logits_no_integer_ties():
    # 10.2 vs 10.4 would both become 10 in the original's integer logit tensor
    logits = 100.0 * torch.tensor([[0.102, 0.104], [0.104, 0.102]])
    m = classification_metrics(logits, torch.tensor([1, 0]))
    assert m["acc1"] == 1.0
    assert m["acc5"] is None  # fewer than 5 classes, as CLIP_benchmark
    truncated = logits.long().float()
    assert classification_metrics(truncated, torch.tensor([1, 0]))["acc1"] < 1.0


def test_targets_out_of_range_rejected():
    with pytest.raises(ValueError):
        classification_metrics(LOGITS, torch.tensor([0, 1, 2, 3, 6]), 6)


# 3 images, 5 captions: captions 0,1 -> image 0; 2 -> image 1; 3,4 -> image 2
T2I = [0, 0, 1, 2, 2]
SCORES = torch.tensor([  # (images, texts)
    [0.1, 0.9, 0.8, 0.2, 0.3],
    [0.5, 0.4, 0.1, 0.3, 0.2],
    [0.2, 0.1, 0.6, 0.5, 0.4],
])


def test_retrieval_recall_by_hand_multiple_positives():
    m = retrieval_metrics_from_scores(SCORES, T2I, ks=(1, 2, 5))
    # image -> text: img0 best text 1 (a positive; its other positive 0 is last) -> hit@1;
    # img1's only positive (2) is ranked 5th; img2 ranks 2,3,4: first positive at rank 2.
    assert m["text_retrieval_recall@1"] == pytest.approx(1 / 3)
    assert m["text_retrieval_recall@2"] == pytest.approx(2 / 3)
    assert m["text_retrieval_recall@5"] == pytest.approx(1.0)
    # text -> image: t0 ranks img1,img2,img0 (miss@2); t1 img0 (hit); t2 img0,img2,img1
    # (miss@2); t3 img2 (hit); t4 img2 (hit)
    assert m["image_retrieval_recall@1"] == pytest.approx(3 / 5)
    assert m["image_retrieval_recall@2"] == pytest.approx(3 / 5)
    assert m["image_retrieval_recall@5"] == pytest.approx(1.0)


# 6 images, 6 captions, caption i describes image i (the diagonal). Rank of the positive:
#   image -> text (rows):    1, 2, 3, 6, 1, 6  -> R@1 2/6, R@5 4/6, R@10 1
#   text -> image (columns): 1, 2, 2, 6, 2, 6  -> R@1 1/6, R@5 4/6, R@10 1
RANKED = torch.tensor([
    [0.995, 0.1, 0.2, 0.3, 0.4, 0.5],
    [0.8, 0.7, 0.0, 0.1, 0.2, 0.3],
    [0.6, 0.5, 0.4, 0.3, 0.2, 0.1],
    [0.15, 0.25, 0.35, 0.05, 0.45, 0.55],
    [0.0, 0.1, 0.2, 0.3, 0.9, 0.4],
    [0.99, 0.98, 0.97, 0.96, 0.95, 0.01],
])


def test_retrieval_recall_at_1_below_recall_at_5_below_1():
    expected = {"text_retrieval_recall@1": 2 / 6, "text_retrieval_recall@5": 4 / 6,
                "text_retrieval_recall@10": 1.0, "image_retrieval_recall@1": 1 / 6,
                "image_retrieval_recall@5": 4 / 6, "image_retrieval_recall@10": 1.0}
    from_scores = retrieval_metrics_from_scores(RANKED, list(range(6)))
    # the same scores as features: image rows against one-hot text features
    from_features = retrieval_metrics(RANKED, torch.eye(6), list(range(6)), normalize=False)
    for m in (from_scores, from_features):
        assert m.keys() == expected.keys()
        for key, value in expected.items():
            assert m[key] == pytest.approx(value), key
        for side in ("text", "image"):
            assert m[f"{side}_retrieval_recall@1"] < m[f"{side}_retrieval_recall@5"] < 1


def test_recall_at_k_rows_and_chunks():
    pos = torch.tensor([[True, False, False], [False, False, True]])
    scores = torch.tensor([[0.1, 0.9, 0.5], [0.3, 0.2, 0.1]])
    assert recall_at_k(scores, pos, 1).tolist() == [False, False]
    assert recall_at_k(scores, pos, 2).tolist() == [False, False]
    assert recall_at_k(scores, pos, 3).tolist() == [True, True]
    big = torch.randn(50, 7)
    bigpos = torch.rand(50, 7) > 0.7
    assert torch.equal(recall_at_k(big, bigpos, 3, chunk=8), recall_at_k(big, bigpos, 3, chunk=1000))


def test_retrieval_from_features_normalises():
    img = torch.eye(3) * torch.tensor([[5.0], [0.1], [2.0]])  # norms differ, directions distinct
    txt = torch.cat([torch.eye(3), torch.eye(3)]) + 0.01
    m = retrieval_metrics(img, txt, [0, 1, 2, 0, 1, 2], ks=(1,))
    assert m["text_retrieval_recall@1"] == 1.0
    assert m["image_retrieval_recall@1"] == 1.0
    with pytest.raises(ValueError):
        retrieval_metrics(img, txt, [0, 1, 2])  # wrong number of captions


def test_headline_metric_per_set():
    for name in ("caltech101", "aircraft", "flowers", "pets"):
        assert headline_metric_name(name) == "mean_per_class_recall"
    for name in ("cifar10", "cifar100", "food101", "sun397", "stanford_car", "dtd", "imagenet"):
        assert headline_metric_name(name) == "acc1"


@pytest.mark.parametrize("n,world", [(0, 2), (1, 3), (5, 2), (10, 3), (7, 7), (100, 8)])
def test_shards_cover_everything_once(n, world):
    seen = [i for r in range(world) for i in shard_range(n, r, world)]
    assert seen == list(range(n))
    sizes = [len(shard_range(n, r, world)) for r in range(world)]
    assert max(sizes) - min(sizes) <= 1


def test_result_record_schema_and_score_line():
    rec = result_record("pets", "RWKV_CLIP_B32", "w.pt", "zeroshot_classification",
                        {"acc1": 0.5, "acc5": 0.9, "mean_per_class_recall": 0.25,
                         "headline_metric": "mean_per_class_recall", "headline": 0.25,
                         "num_samples": 10})
    assert set(rec) >= {"dataset", "model", "pretrained", "task", "metrics"}
    assert rec["metrics"] == {"acc1": 0.5, "acc5": 0.9, "mean_per_class_recall": 0.25}
    assert rec["num_samples"] == 10 and rec["headline_metric"] == "mean_per_class_recall"
    validate_record(rec)
    rec2 = result_record("cifar10", "m", "w.pt", "zeroshot_classification",
                         {"acc1": 0.75, "acc5": 1.0, "mean_per_class_recall": 0.7,
                          "headline_metric": "acc1"})
    assert score_line([rec, rec2]) == "25.0000,75.0000"
    table = summary([rec, rec2])
    assert "pets" in table and "25.00 (mpc)" in table and "75.00 (acc1)" in table
    assert "50.00" in table.splitlines()[-1]  # mean of the paper metrics
    with pytest.raises(ValueError):
        validate_record({**rec, "metrics": {"acc1": float("nan")}})
    with pytest.raises(ValueError):
        result_record("x", "m", "p", "captioning", {})  # not a task of ours
