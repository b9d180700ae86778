"""Export (cmacc.apps.export): torchvision's own r3d_18 / r2plus1d_18 load the exported video
weights and give the project backbone's features (float64, to 1e-10); the stand-alone loaders
rebuild scaled backbones and the audio encoder; every file loads weights-only; the CLI writes a
model card and leaves nothing behind when it fails."""

import json
import subprocess
import sys

import pytest
import torch
import torchvision

from cmacc.apps import export as ex
from cmacc.config import ModelConfig, SelectionConfig
from cmacc.encoders import EncoderFileError, load_audio_encoder, load_video_encoder
from cmacc.model import CMACC


def _randomise_bn(module, seed):
    """Non-trivial BatchNorm statistics, so that eval-mode features depend on the buffers."""
    g = torch.Generator().manual_seed(seed)
    for m in module.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.running_mean.copy_(0.1 * torch.randn(m.running_mean.shape, generator=g))
            m.running_var.copy_(0.5 + torch.rand(m.running_var.shape, generator=g))


def _paper_size_model(arch):
    torch.manual_seed(0)
    cfg = ModelConfig(video_arch=arch, audio_width=4, audio_layers=(1, 1, 1, 1), fcl=False, dim=8,
                      fcl_dim=16, batch_size=4, dict_size=8)
    model = CMACC(cfg, SelectionConfig(sampler="random", pool_size=16))
    _randomise_bn(model.f_v, 1)
    return model


@pytest.mark.parametrize("arch", ["r3d_18", "r2plus1d_18"])
def test_torchvision_loads_the_exported_video_weights_and_gives_the_same_features(arch, tmp_path):
    model = _paper_size_model(arch)
    files = ex.export(model)
    path = tmp_path / f"video_{arch}.pt"
    torch.save(files[f"video_{arch}.pt"], path)

    tv = getattr(torchvision.models.video, arch)()  # as a user would, from torchvision alone
    tv.fc = torch.nn.Identity()
    tv.load_state_dict(torch.load(path, weights_only=True), strict=True)

    x = torch.randn(2, 3, 4, 16, 16, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    ours = model.f_v.backbone.double().eval()
    want = ours(x)
    got = tv.double().eval()(x)
    assert got.shape == (2, 512)
    assert want.abs().max() > 1e-3  # features, not zeros
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


def test_num_classes_adds_a_fresh_fc_that_torchvision_loads_strictly():
    model = _paper_size_model("r3d_18")
    sd = ex.export(model, num_classes=5, seed=3)["video_r3d_18.pt"]
    tv = torchvision.models.video.r3d_18(num_classes=5)
    tv.load_state_dict(sd, strict=True)
    torch.manual_seed(3)
    fresh = torch.nn.Linear(512, 5)  # torchvision's default initialisation, same seed
    torch.testing.assert_close(tv.fc.weight, fresh.weight, rtol=0, atol=0)


def test_keys_exports_the_momentum_encoders():
    model = _paper_size_model("r3d_18")
    with torch.no_grad():
        for p in model.h_a.parameters():
            p.add_(1.0)  # key encoders now differ from the query encoders
    q, k = ex.export(model)["audio_resnet1d.pt"], ex.export(model, keys=True)["audio_resnet1d.pt"]
    for name, v in model.h_a.backbone.state_dict().items():
        torch.testing.assert_close(k[name], v, rtol=0, atol=0)
    assert not torch.equal(q["stem.0.weight"], k["stem.0.weight"])


def test_cli_on_a_tiny_run_writes_weights_only_files_and_a_model_card(tiny_run, tmp_path, capsys):
    out = tmp_path / "exported"
    assert ex.main([str(tiny_run), "--out", str(out)]) == 0
    files = sorted(p.name for p in out.iterdir())
    assert files == ["README.md", "audio_resnet1d.pt", "model_card.json", "video_r3d_18.pt"]
    for name in ("audio_resnet1d.pt", "video_r3d_18.pt"):
        sd = torch.load(out / name, weights_only=True)
        assert sd and all(isinstance(v, torch.Tensor) for v in sd.values())

    from cmacc.apps.eval import load_pretrained

    model, state = load_pretrained(tiny_run)
    g = torch.Generator().manual_seed(0)
    video = torch.randn(2, 3, 8, 32, 32, generator=g, dtype=torch.float64)
    mel = torch.randn(2, 80, 40, generator=g, dtype=torch.float64)
    v = load_video_encoder(out / "video_r3d_18.pt").double()
    a = load_audio_encoder(out / "audio_resnet1d.pt").double()
    torch.testing.assert_close(v(video), model.f_v.backbone.double().eval()(video), rtol=0, atol=1e-10)
    torch.testing.assert_close(a(mel), model.f_a.backbone.double().eval()(mel), rtol=0, atol=1e-10)

    card = json.loads((out / "model_card.json").read_text())
    assert card["steps"] == state["step"] == 6
    assert card["encoders"] == "query"
    assert card["config"]["model"]["video_width"] == 8
    assert card["video"]["torchvision"] is False  # the tiny preset is a scaled copy
    assert card["data"]["source"] == "synthetic"  # what made tiny_run's clips
    assert (card["data"]["clips"], card["data"]["classes"]) == (96, 6)
    assert card["checkpoint"] == str((tiny_run / "ckpt_00000006.pt").resolve())
    import hashlib

    for name, digest in card["sha256"].items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest


def test_safetensors_files_load_into_torchvision_and_the_card_names_data_steps_and_results(
        tiny_run, tmp_path):
    """--format torch safetensors: the .safetensors files hold the .pt files' tensors (so
    torchvision's model loads them as it loads the .pt: test above), the stand-alone loaders
    read them, and README.md is a Hugging Face style card: front matter with the results'
    model-index, the data with its hash, the steps, the loading lines, each result with its
    data."""
    from safetensors.torch import load_file

    from cmacc.apps import eval as ev

    assert ev.main([str(tiny_run), "--modality", "audio", "--out", str(tmp_path / "ev")]) == 0
    run = tmp_path / "run"  # a copy, so that the session's tiny_run keeps no eval of ours
    run.mkdir()
    (run / "ckpt_00000006.pt").write_bytes((tiny_run / "ckpt_00000006.pt").read_bytes())
    (run / "eval").mkdir()
    for f in (tmp_path / "ev").glob("eval_*.json"):
        (run / "eval" / f.name).write_bytes(f.read_bytes())
    out = tmp_path / "exported"
    assert ex.main([str(run), "--out", str(out), "--format", "torch", "safetensors"]) == 0
    for name in ("video_r3d_18", "audio_resnet1d"):
        pt = torch.load(out / f"{name}.pt", weights_only=True)
        st = load_file(out / f"{name}.safetensors")
        assert st.keys() == pt.keys() and all(torch.equal(st[k], pt[k]) for k in pt)
    a = load_audio_encoder(out / "audio_resnet1d.safetensors").double()
    b = load_audio_encoder(out / "audio_resnet1d.pt").double()
    mel = torch.randn(2, 80, 40, dtype=torch.float64)
    torch.testing.assert_close(a(mel), b(mel), rtol=0, atol=0)
    _, what = ev.load_encoder(out / "audio_resnet1d.safetensors")  # cmacc-eval takes it too
    assert what["modality"] == "audio" and what["step"] == 6
    card = json.loads((out / "model_card.json").read_text())
    readme = (out / "README.md").read_text()
    (result, res), = card["eval"].items()
    assert readme.startswith("---\nlibrary_name: pytorch\n") and "model-index:" in readme
    assert f"metrics: [{{type: top1, value: {res['top1_mean']}}}]" in readme
    for said in ("## Method", "## Training data", "`synthetic (--clips 96, ", "6 steps from checkpoint",
                 f"| {result} | audio | linear | {res['top1_mean']:.4f} | synthetic |",
                 "load_audio_encoder('audio_resnet1d.pt')"):
        assert said in readme, said
    assert card["audio"]["files"] == ["audio_resnet1d.pt", "audio_resnet1d.safetensors"]


def test_documented_lines_load_the_export_in_a_fresh_python(tmp_path):
    model = _paper_size_model("r3d_18")
    sd = ex.export(model)["video_r3d_18.pt"]
    torch.save(sd, tmp_path / "video_r3d_18.pt")
    ex.save_weights(sd, tmp_path / "video_r3d_18.safetensors")
    code = ("import torch, torchvision\n"
            "model = torchvision.models.video.r3d_18()\n"
            "model.fc = torch.nn.Identity()\n"
            "model.load_state_dict(torch.load('video_r3d_18.pt', weights_only=True))\n"
            "print(model.eval()(torch.zeros(1, 3, 4, 16, 16)).shape)\n"
            "import safetensors.torch\n"
            "model.load_state_dict(safetensors.torch.load_file('video_r3d_18.safetensors'))\n"
            "print(model.eval()(torch.zeros(1, 3, 4, 16, 16)).shape)\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["torch.Size([1,", "512])"] * 2


def test_loaders_refuse_what_is_not_an_exported_encoder(tmp_path):
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a torch file")
    with pytest.raises(EncoderFileError, match="not a torch state dict"):
        load_audio_encoder(junk)
    torch.save({"stem.0.weight": torch.zeros(3, 3)}, tmp_path / "other.pt")
    with pytest.raises(EncoderFileError, match="1-D audio ResNet"):
        load_audio_encoder(tmp_path / "other.pt")
    with pytest.raises(EncoderFileError, match="no such file"):
        load_video_encoder(tmp_path / "missing.pt")


def test_cli_error_is_one_line_and_leaves_no_out_folder(tmp_path, capsys):
    out = tmp_path / "new" / "exported"
    with pytest.raises(SystemExit) as e:
        ex.main([str(tmp_path / "no_run"), "--out", str(out)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "no_run" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "new").exists()
