"""cmacc.apps.export: a run's encoders out to plain state dicts that torchvision's own video
models and a stand-alone audio loader read (weights-only), with the features of the project's
own backbones (float64, to 1e-10), and a model card that says what they are."""

import dataclasses
import json

import pytest
import torch
import torchvision

from cmacc.apps import export as ex
from cmacc.config import PRESETS
from cmacc.encoders import load_audio_encoder, load_video_backbone
from cmacc.trainer import Trainer


def _run(tmp_path, arch, width, layers):
    """A 1-step run whose video backbone has the given shape (paper shape: torchvision's)."""
    tiny = PRESETS["tiny"]
    cfg = dataclasses.replace(
        tiny, model=dataclasses.replace(tiny.model, video_arch=arch, video_width=width,
                                        audio_width=width,
                                        video_layers=layers, batch_size=4, dict_size=8),
        selection=dataclasses.replace(tiny.selection, pool_size=16),
        data=dataclasses.replace(tiny.data, clips=16, classes=2),
        run=dataclasses.replace(tiny.run, steps=1, log_every=1, out=str(tmp_path / "run")))
    Trainer(cfg).run()
    return tmp_path / "run"


def _same_features(a, b, x):
    a, b = a.double().eval(), b.double().eval()
    with torch.no_grad():
        fa, fb = a(x.double()), b(x.double())
    assert fa.shape == fb.shape
    assert torch.allclose(fa, fb, rtol=0, atol=1e-10), (fa - fb).abs().max()


@pytest.mark.parametrize("arch", ["r3d_18", "r2plus1d_18"])
def test_torchvision_loads_the_exported_video_backbone_with_the_same_features(tmp_path, arch):
    run = _run(tmp_path, arch, 64, (2, 2, 2, 2))
    out = tmp_path / "exported"
    assert ex.main([str(run), "--out", str(out)]) == 0
    from cmacc.apps.eval import load_pretrained

    model, _ = load_pretrained(run)
    mine = model.f_v.backbone
    net = getattr(torchvision.models.video, arch)()
    net.fc = torch.nn.Identity()  # the two documented lines
    net.load_state_dict(torch.load(out / f"video_{arch}.pt", weights_only=True))  # strict
    x = torch.randn(2, 3, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    _same_features(mine, net, x)
    # with a fresh classifier of --num-classes: torchvision's model with that head, strict
    out2 = tmp_path / "exported_fc"
    assert ex.main([str(run), "--out", str(out2), "--num-classes", "7", "--keys"]) == 0
    net7 = getattr(torchvision.models.video, arch)(num_classes=7)
    net7.load_state_dict(torch.load(out2 / f"video_{arch}.pt", weights_only=True))
    net7.fc = torch.nn.Identity()
    _same_features(model.h_v.backbone, net7, x)  # --keys: the momentum encoder
    card = json.loads((out / "model_card.json").read_text())
    assert card["video"]["torchvision_loadable"] and card["steps"] == 1
    assert card["encoders"] == "query" and card["video"]["classifier"] is None


def test_a_scaled_backbone_and_the_audio_encoder_load_on_their_own(tmp_path):
    run = _run(tmp_path, "r2plus1d_18", 8, (1, 2, 1, 1))
    out = tmp_path / "exported"
    assert ex.main([str(run), "--out", str(out)]) == 0
    from cmacc.apps.eval import load_pretrained

    model, state = load_pretrained(run)
    video = load_video_backbone(out / "video_r2plus1d_18.pt")
    keys = set(torch.load(out / "video_r2plus1d_18.pt", weights_only=True))
    assert "layer2.1.conv1.0.0.weight" in keys and not any(k.startswith("blocks.") for k in keys)
    _same_features(model.f_v.backbone, video, torch.randn(2, 3, 4, 16, 16))
    audio = load_audio_encoder(out / "audio_resnet1d.pt")
    _same_features(model.f_a.backbone, audio, torch.randn(2, 80, 40))
    card = json.loads((out / "model_card.json").read_text())
    assert not card["video"]["torchvision_loadable"] and card["video"]["layers"] == [1, 2, 1, 1]
    assert card["config"]["model"]["video_width"] == 8 and card["data"]["source"] == "synthetic"


def test_export_errors_are_one_line_and_create_nothing(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        ex.main([str(tmp_path / "nothing"), "--out", str(tmp_path / "o")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no such checkpoint file or run folder" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "o").exists()
