"""The notebook classifier: open_clip's class-embedding recipe on this model, and the same
predictions as zero_shot.py on the built-in held-out split."""
import json

import pytest
import torch
import torch.nn.functional as F

import rwkv_clip


@pytest.fixture(scope="module")
def heldout(tmp_path_factory):
    from rwkv_clip.data import ensure_builtin_dataset

    root = tmp_path_factory.mktemp("builtin")
    return ensure_builtin_dataset(root=str(root), seed=0, num_train=30, num_val=0,
                                  zeroshot_per_class=2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.manual_seed(5)
    model = rwkv_clip.create_RWKV_Model(rwkv_clip.load_model_configs("RWKV_CLIP_tiny")).eval()
    path = tmp_path_factory.mktemp("w") / "tiny.pt"
    torch.save(model.state_dict(), path)
    return model, path


def test_class_embeddings_follow_open_clip_recipe(tiny):
    """Per class: encode every filled template, L2-normalise, average, normalise."""
    model, _ = tiny
    classnames, templates = ["red square", "blue circle", "green star"], ["a {}.", "a photo of a {}."]
    tokenizer = rwkv_clip.get_tokenizer("RWKV_CLIP_tiny")
    weights = rwkv_clip.build_zero_shot_classifier(model, tokenizer, classnames, templates)
    assert weights.shape == (64, 3) and weights.dtype == torch.float32
    with torch.no_grad():
        for i, name in enumerate(classnames):
            feats = model.encode_text(tokenizer([t.format(name) for t in templates]))
            expected = F.normalize(F.normalize(feats, dim=-1).mean(dim=0), dim=0)
            assert torch.allclose(weights[:, i], expected, atol=1e-6)
    assert model.training is False


def test_classifier_agrees_with_zero_shot_py_on_the_heldout_split(heldout, tiny, tmp_path, capsys):
    from rwkv_clip.eval.datasets import image_folder_set
    from rwkv_clip.eval.zeroshot import build_classifier, classification_logits
    from rwkv_clip.transform import image_transform
    from zero_shot import main as zero_shot_main

    model, weights = tiny
    rc = zero_shot_main(["--model-weight", str(weights), "--dataset", "imagefolder",
                         "--data-root", heldout.zeroshot_dir, "--workers", "0", "--device",
                         "cpu", "--batch-size", "16", "--output-dir", str(tmp_path)])
    assert rc == 0, capsys.readouterr().err
    record = json.loads((tmp_path / "imagefolder_zeroshot_classification.json").read_text())

    eval_set = image_folder_set(heldout.zeroshot_dir, image_transform(16, is_train=False))
    assert len(eval_set) == 60 and eval_set.num_classes == 30
    images = torch.stack([eval_set.dataset[i][0] for i in range(len(eval_set))])
    targets = torch.tensor([eval_set.dataset[i][1] for i in range(len(eval_set))])
    probs = rwkv_clip.classify(model, images, eval_set.classnames, eval_set.templates)
    assert probs.shape == (60, 30)
    assert torch.allclose(probs.sum(dim=1), torch.ones(60), atol=1e-5)
    predictions = probs.argmax(dim=1)
    acc1 = (predictions == targets).double().mean().item()
    assert acc1 == pytest.approx(record["metrics"]["acc1"], abs=1e-9)
    classifier = build_classifier(model, eval_set.classnames, eval_set.templates, "cpu")
    logits, eval_targets = classification_logits(model, eval_set, classifier, "cpu", 16)
    assert torch.equal(eval_targets, targets)
    assert torch.equal(logits.argmax(dim=1), predictions)  # sample by sample


def test_classify_takes_pil_images_and_the_paper_templates(heldout, tiny):
    from PIL import Image

    from rwkv_clip.eval.datasets import default_templates
    from rwkv_clip.transform import image_transform

    model, _ = tiny
    classnames = ["red circle", "blue square"]
    images = [Image.new("RGB", (30, 20), "red"), Image.new("RGB", (20, 30), "blue")]
    from_pil = rwkv_clip.classify(model, images, classnames)
    preprocess = image_transform(16, is_train=False)
    batch = torch.stack([preprocess(image) for image in images])
    paper = rwkv_clip.classify(model, batch, classnames, templates=default_templates("imagenet"))
    assert len(default_templates("imagenet")) == 80
    assert torch.allclose(from_pil, paper, atol=1e-6)
    one = rwkv_clip.classify(model, images[0], classnames)
    assert torch.allclose(one[0], from_pil[0], atol=1e-6)
