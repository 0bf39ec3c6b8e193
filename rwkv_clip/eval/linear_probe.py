"""Linear probe: a multinomial logistic regression on frozen, L2-normalised image features.

CLIP's protocol (Radford et al. 2021, appendix A.3) as CLIP_benchmark's ``linear_probe``
task, with its result names (``lp_acc1``, ``lp_acc5``, ``lp_mean_per_class_recall``); the
L2 strength search over :data:`LAMBDAS` is in docs/linear-probe-and-validation.md.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import EvalError
from .metrics import classification_metrics

# L2 strengths of the search (CLIP: 1e-6 .. 1e6 logarithmically spaced); C = 1 / lambda.
LAMBDAS = tuple(float(v) for v in np.logspace(-6, 6, 97))
COARSE_STRIDE = 16  # the first pass: 1e-6, 1e-4, ..., 1e6
MAX_ITER = 1000
DEFAULT_VAL_PROPORTION = 0.2


def _sklearn():
    try:
        from sklearn.linear_model import LogisticRegression
    except ImportError:
        raise EvalError("the linear probe needs scikit-learn: pip install scikit-learn "
                        "(or pip install 'rwkv-clip[linear-probe]')") from None
    return LogisticRegression


@dataclass
class Features:
    """Image features (N, C) float32 and their class indices (N,) int64."""
    features: torch.Tensor
    targets: torch.Tensor

    def __len__(self) -> int:
        return int(self.targets.shape[0])

    def take(self, indices: Sequence[int] | torch.Tensor) -> Features:
        idx = torch.as_tensor(indices, dtype=torch.long)
        return Features(self.features[idx], self.targets[idx])


def split_train_val(targets: torch.Tensor, val_proportion: float, seed: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(fit indices, held-out indices): ``val_proportion`` of every class, drawn with
    ``seed``, held out; a class keeps at least one fitting sample."""
    if not 0.0 < val_proportion < 1.0:
        raise EvalError(f"the held-out proportion must lie in (0, 1), got {val_proportion}")
    g = torch.Generator().manual_seed(int(seed))
    fit, val = [], []
    for c in torch.unique(targets).tolist():
        members = (targets == c).nonzero().view(-1)
        members = members[torch.randperm(members.numel(), generator=g)]
        n_val = min(int(members.numel() * val_proportion), members.numel() - 1)
        val.append(members[:n_val])
        fit.append(members[n_val:])
    return torch.cat(fit).sort().values, torch.cat(val).sort().values


def select_fewshot(targets: torch.Tensor, k: int, seed: int,
                   classnames: Sequence[str] | None = None) -> torch.Tensor:
    """Indices of ``k`` samples of every class, drawn with ``seed``; a class with fewer
    is an error (CLIP_benchmark: 'insufficient data') that names the largest k that fits."""
    g = torch.Generator().manual_seed(int(seed))
    chosen, short = [], []
    counts = {}
    for c in torch.unique(targets).tolist():
        members = (targets == c).nonzero().view(-1)
        counts[c] = members.numel()
        if members.numel() < k:
            name = classnames[c] if classnames is not None and c < len(classnames) else f"class {c}"
            short.append(f"{name}: {members.numel()}")
        chosen.append(members[torch.randperm(members.numel(), generator=g)[:k]])
    if short:
        raise EvalError(f"--fewshot-k {k}: too few training samples after the held-out part "
                        f"in {len(short)} class(es) ({', '.join(short[:5])}"
                        f"{', ...' if len(short) > 5 else ''}); use --fewshot-k "
                        f"{min(counts.values())} or less")
    return torch.cat(chosen).sort().values


def check_fewshot(targets: torch.Tensor, k: int, val_proportion: float, seed: int,
                  classnames: Sequence[str] | None = None) -> None:
    """Raise :func:`select_fewshot`'s error now when ``k`` per class will not fit the
    train split of ``targets`` once its held-out part is set aside (before any encoding)."""
    if k > 0:
        fit_idx, _ = split_train_val(targets, val_proportion, seed)
        select_fewshot(targets[fit_idx], k, seed, classnames)


def fit_logistic(train: Features, C: float, seed: int = 0):
    """A multinomial L2 logistic regression (L-BFGS) fitted on ``train``."""
    LogisticRegression = _sklearn()
    clf = LogisticRegression(C=C, max_iter=MAX_ITER, random_state=seed)
    with warnings.catch_warnings():  # weak regularisation on separable data stops at max_iter
        warnings.simplefilter("ignore")
        clf.fit(train.features.double().numpy(), train.targets.numpy())
    return clf


def class_logits(clf, features: torch.Tensor, num_classes: int) -> torch.Tensor:
    """(N, num_classes) class scores (the softmax's logits, so the same ranking as the
    probabilities); classes the fit never saw get -inf."""
    scores = np.asarray(clf.decision_function(features.double().numpy()), dtype=np.float64)
    if scores.ndim == 1:  # two classes: scikit-learn returns the second class's margin
        scores = np.stack([-scores / 2, scores / 2], axis=1)
    out = torch.full((features.shape[0], num_classes), float("-inf"), dtype=torch.float64)
    out[:, torch.as_tensor(clf.classes_, dtype=torch.long)] = torch.from_numpy(scores)
    return out.float()


def val_accuracy(train: Features, val: Features, C: float, num_classes: int,
                 seed: int = 0) -> float:
    clf = fit_logistic(train, C, seed)
    pred = class_logits(clf, val.features, num_classes).argmax(dim=1)
    return (pred == val.targets).double().mean().item()


def search_grid(score: Callable[[int], float], size: int, stride: int = COARSE_STRIDE
                ) -> tuple[int, dict[int, float]]:
    """The index of ``range(size)`` with the highest ``score``: every ``stride``-th index
    first, then the best one's neighbours at half the stride, halving down to 1
    (CLIP_benchmark's search; exact for a unimodal score). Ties go to the larger index
    (the stronger regularisation). Returns (index, {index: score of every index tried})."""
    tried: dict[int, float] = {}

    def best(indices) -> int:
        for i in indices:
            if i not in tried:
                tried[i] = score(i)
        return max(indices, key=lambda i: (tried[i], i))

    peak = best(sorted({*range(0, size, stride), size - 1}))
    span = stride // 2
    while span > 0:
        peak = best(sorted({max(peak - span, 0), peak, min(peak + span, size - 1)}))
        span //= 2
    return peak, dict(sorted(tried.items()))


def search_regularization(train: Features, val: Features, num_classes: int, seed: int = 0,
                          lambdas: Sequence[float] = LAMBDAS, log=None
                          ) -> tuple[float, dict[float, float]]:
    """The L2 strength of ``lambdas`` whose fit on ``train`` scores the best top-1 on
    ``val`` (:func:`search_grid`). Returns (lambda, {lambda: held-out top-1 of every value
    tried})."""
    def score(i: int) -> float:
        acc = val_accuracy(train, val, 1.0 / lambdas[i], num_classes, seed)
        if log is not None:
            log(f"  lambda {lambdas[i]:.3g}: held-out top-1 {100 * acc:.2f}%")
        return acc

    peak, tried = search_grid(score, len(lambdas))
    return float(lambdas[peak]), {float(lambdas[i]): a for i, a in tried.items()}


def linear_probe(train: Features, test: Features, num_classes: int, fewshot_k: int = -1,
                 val_proportion: float = DEFAULT_VAL_PROPORTION, seed: int = 0,
                 lambdas: Sequence[float] = LAMBDAS, log=None) -> dict:
    """The probe's metrics: search lambda on a held-out part of ``train``, refit on all of
    ``train`` (or its ``fewshot_k`` per class), score ``test``."""
    if len(train) == 0 or len(test) == 0:
        raise EvalError(f"the linear probe needs train and test samples, got {len(train)} "
                        f"and {len(test)}")
    fit_idx, val_idx = split_train_val(train.targets, val_proportion, seed)
    fit = train.take(fit_idx)
    if fewshot_k > 0:
        fit = fit.take(select_fewshot(fit.targets, fewshot_k, seed))
    if len(val_idx) > 0 and len(lambdas) > 1:
        lam, tried = search_regularization(fit, train.take(val_idx), num_classes, seed,
                                           lambdas, log)
    else:  # nothing to hold out (one sample per class): the middle of the range
        lam, tried = float(lambdas[len(lambdas) // 2]), {}
    final = fit if fewshot_k > 0 else train  # few-shot: only the k-shot set, as CLIP_benchmark
    clf = fit_logistic(final, 1.0 / lam, seed)
    m = classification_metrics(class_logits(clf, test.features, num_classes), test.targets,
                               num_classes)
    return {"lp_acc1": m["acc1"], "lp_acc5": m["acc5"],
            "lp_mean_per_class_recall": m["mean_per_class_recall"],
            "C": 1.0 / lam, "l2_lambda": lam,
            "val_acc1": tried.get(lam), "fewshot_k": fewshot_k, "seed": seed,
            "val_proportion": val_proportion, "num_train": len(final),
            "num_samples": len(test)}


def evaluate_linear_probe(model, dataset: str, data_root, input_size: int,
                          device: torch.device | str, batch_size: int = 64, workers: int = 0,
                          precision: str = "fp32", fewshot_k: int = -1,
                          val_proportion: float = DEFAULT_VAL_PROPORTION, seed: int = 0,
                          feature_dir=None, info=None, log=None, builtin=None) -> dict:
    """Linear-probe metrics of ``model`` on ``dataset`` (builtin, imagefolder with
    ``train/`` and ``test/``, or a paper set): features of both splits (cached in
    ``feature_dir``, default :func:`.feature_cache.default_feature_dir`), then
    :func:`linear_probe` on rank 0; every rank returns the same dict. ``builtin``: a
    :class:`~rwkv_clip.data.builtin.BuiltinDataset` to use for ``builtin`` instead of the
    default one."""
    from .distributed import current, fail_together
    from .feature_cache import cached_features, default_feature_dir, weights_fingerprint
    from .probe_data import dataset_targets, probe_splits
    from .transforms import eval_transform
    from .zeroshot import unwrap_model

    _sklearn()  # a missing package is an error before any image is encoded
    info = info or current()
    device = torch.device(device)
    model = unwrap_model(model)
    transform = eval_transform(dataset, input_size)
    train_set, test_set = probe_splits(dataset, data_root, transform, builtin=builtin)
    targets = dataset_targets(train_set.dataset)
    if targets is not None:  # a --fewshot-k too large fails before anything is encoded
        check_fewshot(targets, fewshot_k, val_proportion, seed, test_set.classnames)
    if log is not None:
        log(f"{train_set.name}: linear probe, {len(train_set)} train / {len(test_set)} test "
            f"images, {test_set.num_classes} classes: encoding both splits (unless cached, "
            f"the estimate follows the first batch), then fitting")
    fingerprint = weights_fingerprint(model)
    root = (builtin.root if builtin is not None else "builtin") if dataset == "builtin" else \
        str(Path(data_root).resolve())
    common = dict(cache_dir=feature_dir or default_feature_dir(), fingerprint=fingerprint,
                  root=root, transform=transform, device=device, batch_size=batch_size,
                  workers=workers, precision=precision, info=info, log=log)
    was_training = model.training
    model.eval()
    try:
        train = Features(*cached_features(model, train_set, "train", **common))
        test = Features(*cached_features(model, test_set, "test", **common))
    finally:
        model.train(was_training)
    result = None
    with fail_together(info):  # the fit runs on rank 0; an error there stops every rank
        if info.is_master:
            result = linear_probe(train, test, test_set.num_classes, fewshot_k,
                                  val_proportion, seed, log=log)
    if info.world_size > 1:
        import torch.distributed as dist
        box = [result]
        dist.broadcast_object_list(box, src=0)
        result = box[0]
    if result is None:
        raise EvalError("the linear probe returned no result")
    return result
